"""TRL's tool-call preference data as its generator script writes it, through SimPODisRMTrainer and RewardTrainer.

TRL's `scripts/generate_toolcall_dataset.py` builds `trl-internal-testing/toolcall` with
`Dataset.from_dict(..., on_mixed_types="use_json")`: the `chosen` / `rejected` lists of messages (tool calls with
arguments of different types, tool answers with a `name`, plain replies) are stored with datasets' `Json` feature
(`arrow.json` in the parquet file), and each row's `tools` as JSON text (the Hub copy RewardTrainer's
`test_train_toolcall_data` reads). `test_train_toolcall_data_as_json` then maps `tools` to a list of dicts. Both
must give the token ids stock RewardTrainer gives, and train.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset, Json, List, Value, load_dataset
from trainer_helpers import cpu_args
from transformers.utils import get_json_schema
from trl import RewardConfig, RewardTrainer

from trl_longrm import SimPODisRMConfig, SimPODisRMTrainer
from trl_longrm.data import load_preference_dataset
from trl_longrm.testing_utils import build_tiny_model


def start_timer(duration: int) -> int:
    """
    Starts a timer for the specified duration in seconds.

    Args:
        duration: Duration in seconds to set the timer for.
    """
    return duration


def get_current_time(location: str) -> str:
    """
    Returns the current time in the specified location.

    Args:
        location: The location for which to get the current time.
    """
    return "06:22:48"


def get_weather_forecast(city: str, date: str) -> dict:
    """
    Returns the weather forecast for the specified city and date.

    Args:
        city: The city for which to get the weather forecast.
        date: The date for which to get the weather forecast.
    """
    return {"temperature": 22, "condition": "partly cloudy"}


def get_wind_conditions(city: str, unit: str) -> tuple[int, str]:
    """
    Returns the wind conditions for the specified city.

    Args:
        city: The city for which to get the wind conditions.
        unit: The unit of measurement for the wind speed (e.g., "mph").
    """
    return 14, "NW"


def call(name: str, arguments: dict, answer: str, reply: str) -> list[dict]:
    """An assistant's tool call (no content), the tool's answer, the assistant's reply: TRL's tool-call completion."""
    return [
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "name": name, "content": answer},
        {"role": "assistant", "content": reply},
    ]


def toolcall_preference_parquet(path: Path) -> Path:
    """Rows of TRL's toolcall `preference` config, built as its generator script builds them (`from_dict` with
    `on_mixed_types="use_json"`, `tools` as JSON text), saved as parquet as `push_to_hub` saves them."""
    timer, clock = get_json_schema(start_timer), get_json_schema(get_current_time)
    forecast, wind = get_json_schema(get_weather_forecast), get_json_schema(get_wind_conditions)
    dataset = Dataset.from_dict(
        {
            "prompt": [
                [{"role": "user", "content": "Set a timer for 10 minutes."}],
                [{"role": "user", "content": "What time is it in Tokyo?"}],
                [{"role": "user", "content": "What's the weather like tomorrow in Berlin?"}],
                [{"role": "user", "content": "How strong is the wind in Chicago right now?"}],
            ],
            "chosen": [
                call("start_timer", {"duration": 600}, "600", "Timer set for 10 minutes."),
                call("get_current_time", {"location": "Tokyo"}, "06:22:48", "The current time in Tokyo is 06:22 AM."),
                call(
                    "get_weather_forecast",
                    {"city": "Berlin", "date": "2025-06-16"},
                    "{'temperature': 22, 'condition': 'partly cloudy'}",
                    "Tomorrow in Berlin will be partly cloudy with a high of 22°C.",
                ),
                call(
                    "get_wind_conditions",
                    {"city": "Chicago", "unit": "mph"},
                    "(14, 'NW')",
                    "The wind in Chicago is blowing at 14 mph from the northwest.",
                ),
            ],
            "rejected": [
                call("start_timer", {"duration": 10}, "10", "Timer set for 10 seconds."),
                [{"role": "assistant", "content": "It is 6:22 AM in Tokyo."}],
                [{"role": "assistant", "content": "Tomorrow in Berlin will be hot and sunny."}],
                call(
                    "get_weather_forecast",
                    {"city": "Chicago", "date": "2025-06-16"},
                    "{'temperature': 22, 'condition': 'partly cloudy'}",
                    "Tomorrow in Chicago will be partly cloudy with a high of 22°C.",
                ),
            ],
            "tools": [json.dumps(tools) for tools in ([timer], [clock], [forecast], [wind])],
        },
        on_mixed_types="use_json",
    )
    file = path / "preference-train.parquet"
    dataset.to_parquet(str(file))
    return file


@pytest.fixture
def qwen_tokenizer(tokenizer):
    """The test tokenizer with TRL's Qwen2.5 chat template, which renders tools, tool calls and tool answers."""
    import copy

    templated = copy.deepcopy(tokenizer)
    templated.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return templated


@pytest.mark.parametrize("tools_as", ["json_text", "structured"])
def test_trl_toolcall_preference_data_tokenised_as_stock_and_trained(tmp_path, qwen_tokenizer, tools_as):
    """TRL's `test_train_toolcall_data` (`tools` as JSON text) and `test_train_toolcall_data_as_json` (`tools` mapped
    to dicts) on the dataset as TRL's generator writes it: the same `chosen_ids` / `rejected_ids` as RewardTrainer's,
    token for token, and two training steps that change the weights."""
    dataset = load_dataset("parquet", data_files=str(toolcall_preference_parquet(tmp_path)), split="train")
    # The layout of the Hub copy: messages as JSON values, tools as text (structs would fill absent keys with None).
    assert dataset.features["chosen"] == List(Json()) and dataset.features["rejected"] == List(Json())
    assert dataset.features["tools"] == Value("string")
    if tools_as == "structured":
        dataset = dataset.map(lambda example: {"tools": json.loads(example["tools"])})

    model = build_tiny_model("qwen3", "seq-cls", qwen_tokenizer, seed=1)
    common = cpu_args(tmp_path, max_length=1024, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3)
    stock = RewardTrainer(
        model=model, args=RewardConfig(**common), train_dataset=dataset, processing_class=qwen_tokenizer
    )
    ours = SimPODisRMTrainer(
        model=model, args=SimPODisRMConfig(**common), train_dataset=dataset, processing_class=qwen_tokenizer
    )
    assert ours.train_dataset["chosen_ids"] == stock.train_dataset["chosen_ids"]
    assert ours.train_dataset["rejected_ids"] == stock.train_dataset["rejected_ids"]
    # The rendering holds the row's tool, the call with its arguments and the tool's answer.
    rendered = qwen_tokenizer.decode(ours.train_dataset[0]["chosen_ids"])
    assert '"name": "start_timer"' in rendered and '"arguments": {"duration": 600}' in rendered
    assert "<tool_response>\n600\n</tool_response>" in rendered

    before = {name: param.detach().clone() for name, param in ours.model.named_parameters()}
    ours.train()
    assert torch.isfinite(torch.tensor(ours.state.log_history[-1]["train_loss"]))
    changed = [name for name, param in ours.model.named_parameters() if not torch.equal(before[name], param)]
    assert len(changed) == len(before)


def test_toolcall_records_keep_the_messages_as_json_text(tmp_path):
    """Normalising the `Json`-typed columns gives canonical records: each response the JSON text of its messages,
    without the keys a message lacks (a struct column would have filled them with None)."""
    dataset = load_dataset("parquet", data_files=str(toolcall_preference_parquet(tmp_path)), split="train")
    records = load_preference_dataset(dataset)
    assert records.features["chosen"] == Value("string")
    assert records.features["rejected"] == List(Value("string"))
    assert json.loads(records[1]["chosen"])[0] == {
        "role": "assistant",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_current_time", "arguments": {"location": "Tokyo"}}}
        ],
    }
    assert json.loads(records[1]["rejected"][0]) == [{"role": "assistant", "content": "It is 6:22 AM in Tokyo."}]
    assert json.loads(records[0]["chat_template_kwargs"])["tools"][0]["function"]["name"] == "start_timer"


def test_long_sft_sends_json_tool_call_messages_to_the_stock_path(tmp_path, qwen_tokenizer):
    """TRL's toolcall `language_modeling` rows without their `tools` column: stored as `Json` values, their messages'
    `tool_calls` are not in the schema, yet LongSFTTrainer must still see them and train through stock SFTTrainer's
    path (as it does for struct-typed tool calls), with stock's token ids."""
    from trl import SFTConfig, SFTTrainer

    from trl_longrm import LongSFTConfig, LongSFTTrainer

    messages = [
        [{"role": "user", "content": "Set a timer for 10 minutes."}]
        + call("start_timer", {"duration": 600}, "600", "Timer set for 10 minutes."),
        [{"role": "user", "content": "What time is it in Tokyo?"}]
        + call("get_current_time", {"location": "Tokyo"}, "06:22:48", "The current time in Tokyo is 06:22 AM."),
    ]
    dataset = Dataset.from_dict({"messages": messages}, on_mixed_types="use_json")
    assert dataset.features["messages"] == List(Json())
    model = build_tiny_model("qwen3", "causal-lm", qwen_tokenizer, seed=1)
    common = cpu_args(tmp_path, max_length=1024, max_steps=1, per_device_train_batch_size=2)
    stock = SFTTrainer(model=model, args=SFTConfig(**common), train_dataset=dataset, processing_class=qwen_tokenizer)
    ours = LongSFTTrainer(
        model=model, args=LongSFTConfig(**common), train_dataset=dataset, processing_class=qwen_tokenizer
    )
    assert ours._stock_path
    assert ours.train_dataset["input_ids"] == stock.train_dataset["input_ids"]
    ours.train()
