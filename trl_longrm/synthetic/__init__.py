"""Synthetic long-context judging data whose answers depend on the context, and the settings of the tiny demo.

Example:
```python
>>> from trl_longrm.synthetic import generate_synthetic_suite
>>> suite = generate_synthetic_suite("/tmp/synthetic", seed=0, num_train=200)
>>> sorted(p.name for p in suite.benchmark.iterdir())[:2]
['Cite.jsonl', 'Code.jsonl']
```
"""

from trl_longrm.synthetic.suite import (
    JudgingExample,
    SuiteBuilder,
    SyntheticConfig,
    SyntheticSuite,
    generate_synthetic_suite,
    judgment,
    pointwise_judgment,
)
from trl_longrm.synthetic.world import (
    SURFACES,
    VALUES,
    FactSheet,
    count_errors,
    key_split,
    make_fact_sheet,
    make_responses,
    parse_facts,
    split_keys,
)


__all__ = [
    "SURFACES",
    "VALUES",
    "FactSheet",
    "JudgingExample",
    "SuiteBuilder",
    "SyntheticConfig",
    "SyntheticSuite",
    "count_errors",
    "generate_synthetic_suite",
    "judgment",
    "key_split",
    "make_fact_sheet",
    "make_responses",
    "parse_facts",
    "pointwise_judgment",
    "split_keys",
]
