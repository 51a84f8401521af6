import os
from pathlib import Path

import pytest


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SHARED_SAMPLE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "longrm_simpo_sample"


@pytest.fixture(scope="session")
def tokenizer():
    from trl_longrm.testing_utils import build_chat_tokenizer

    return build_chat_tokenizer()


@pytest.fixture(scope="session")
def shared_sample_path():
    if not SHARED_SAMPLE.exists():
        pytest.skip(f"the real LongRM sample is not present at {SHARED_SAMPLE} (../shared is absent)")
    return SHARED_SAMPLE
