"""The benchmarks' own library (bench/*.py import it; the product package never does).

- `throughput`: FLOP count, head-only Kimi-K2.5 verifier, synthetic prepared data, plain
  speculators with step timing (bench/train_throughput.py, bench/learning_parity.py);
- `acceptance`: the offline tau estimate, and the bench's prompt files measured in vLLM by the product's
  `eagle3_pipeline.evaluate` (stage 06 measures with the same code) (bench/acceptance.py);
- `organism`: the small real chat model acceptance is measured on (bench/acceptance.py).

The benchmarks use the pipeline's library, `eagle3_pipeline`, installed by `make venv`
(pyproject.toml). A GPU box may run them with its own Python, where that install was not made;
there the checkout's copy beside the numbered scripts is used, so no benchmark needs
`pip install -e .` to start.
"""

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("eagle3_pipeline") is None:
    sys.path.append(str(Path(__file__).resolve().parents[2] / "eagle3-train"))
