"""Preference and SFT data for trl_longrm: loading, normalisation to canonical records, and tokenisation.

Example:
```python
>>> from trl_longrm.data import load_preference_dataset, tokenize_preference_dataset
>>> groups = load_preference_dataset("path/to/longrm_simpo_sample", split="train")  # prompt, chosen, rejected
>>> tokenized, report = tokenize_preference_dataset(groups, tokenizer, max_length=32768, truncation="truncate_prompt")
>>> tokenized.column_names
['prompt_ids', 'chosen_completion_ids', 'rejected_completion_ids']
```
"""

from .errors import DataFormatError
from .records import (
    DATA_FORMATS,
    KNOWN_ROLES,
    PreferenceLayout,
    SFTLayout,
    normalize_preference_record,
    normalize_sft_record,
    resolve_preference_layout,
    resolve_sft_layout,
)
from .sources import load_preference_dataset, load_raw_dataset, load_sft_dataset, read_source
from .streaming import StreamTally, stream_preference_dataset
from .tokenization import (
    TRUNCATION_POLICIES,
    TokenizationReport,
    scoring_ids,
    tokenize_preference_dataset,
    tokenize_preference_record,
    tokenize_sft_dataset,
    tokenize_sft_record,
)
from .truncation import cut_middle, truncate_middle_to_fit


__all__ = [
    "DATA_FORMATS",
    "KNOWN_ROLES",
    "TRUNCATION_POLICIES",
    "DataFormatError",
    "PreferenceLayout",
    "SFTLayout",
    "StreamTally",
    "TokenizationReport",
    "cut_middle",
    "load_preference_dataset",
    "load_raw_dataset",
    "load_sft_dataset",
    "normalize_preference_record",
    "normalize_sft_record",
    "read_source",
    "resolve_preference_layout",
    "resolve_sft_layout",
    "scoring_ids",
    "stream_preference_dataset",
    "tokenize_preference_dataset",
    "tokenize_preference_record",
    "tokenize_sft_dataset",
    "tokenize_sft_record",
    "truncate_middle_to_fit",
]
