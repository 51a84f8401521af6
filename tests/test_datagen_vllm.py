"""Sampling engines against real vLLM (its own venv, `make vllm`): a served tiny model samples `n` continuations per
request under the request's seed, on the token-id route (`OpenAIGenerator.sample`) and the chat route
(`OpenAIChatGenerator`), and `respond` samples its responders through the server; `VLLMGenerator.sample` in process.

One server for the module (a start takes about a minute on 2 cores) and one in-process engine.
"""

import json

import pytest
from datagen_helpers import read_jsonl, short_records, write_corpus, write_jsonl
from vllm_support import VLLM_SHAPE, run_in_vllm_venv, vllm_server

from trl_longrm.serving import OpenAIChatGenerator, OpenAIGenerator, Sampling
from trl_longrm.testing_utils import build_chat_tokenizer, save_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_sampling")
    return save_tiny_model(root / "lm", arch="qwen3", tokenizer=build_chat_tokenizer(), seed=5, **VLLM_SHAPE)


@pytest.fixture(scope="module")
def server(model):
    with vllm_server(model, "--enable-prefix-caching", served_model_name="responder") as running:
        yield running


@pytest.mark.slow
def test_token_route_samples_n_under_the_requests_seed(server, model):
    tokenizer = build_chat_tokenizer()
    engine = OpenAIGenerator(server.base_url, "responder", tokenizer=tokenizer)
    prompts = [tokenizer("the city of", add_special_tokens=False)["input_ids"], [5, 6, 7, 8]]
    seeded = [Sampling(n=4, temperature=1.0, seed=11), Sampling(n=2, temperature=1.0, seed=12)]
    first = engine.sample(prompts, 8, seeded)
    assert [len(group) for group in first] == [4, 2]
    assert all(1 <= len(g.token_ids) <= 8 for group in first for g in group)
    assert len({tuple(g.token_ids) for g in first[0]}) > 1  # sampled, not one greedy answer
    # The same request and seed: the same samples, whatever else is in flight with it.
    assert engine.sample(prompts[:1], 8, seeded[:1]) == first[:1]
    other = engine.sample(prompts[:1], 8, Sampling(n=4, temperature=1.0, seed=99))
    assert other != first[:1]
    # Temperature 0: the greedy continuation, n times.
    greedy = engine.sample(prompts[:1], 8, Sampling(n=2, temperature=0.0))[0]
    assert greedy[0] == greedy[1] == engine.generate(prompts[:1], 8)[0]


@pytest.mark.slow
def test_chat_route_answers_messages(server):
    engine = OpenAIChatGenerator(server.base_url, "responder")
    messages = [{"role": "user", "content": "Name a river."}]
    answers = engine.chat([messages, messages], 6, Sampling(n=3, temperature=1.0, seed=7))
    assert [len(group) for group in answers] == [3, 3]
    assert answers[0] == answers[1]  # one seed, one prompt: the same answers
    assert all(a.prompt_tokens and a.prompt_tokens > 5 and a.completion_tokens for a in answers[0])
    assert answers[0][0].finish_reason in ("stop", "length")


@pytest.mark.slow
def test_chat_route_continues_a_prefilled_answer_as_the_token_route_does(server):
    # A conversation ending with an assistant turn is continued (vLLM's `continue_final_message`): the chat route's
    # greedy answer is the token route's on our own rendering of it (`TokenChatModel`, which the other backends use).
    from trl_longrm.datagen.models import ModelSpec, ServerChatModel, TokenChatModel

    tokenizer = build_chat_tokenizer()
    messages = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The river"}]
    greedy = [Sampling(n=1, temperature=0.0)]
    chat = ServerChatModel(ModelSpec(name="c", backend="chat", base_url=server.base_url),
                           OpenAIChatGenerator(server.base_url, "responder"))  # fmt: skip
    tokens = TokenChatModel(ModelSpec(name="t", backend="openai", base_url=server.base_url, tokenizer="unused"),
                            OpenAIGenerator(server.base_url, "responder", tokenizer=tokenizer), tokenizer)  # fmt: skip
    [[continued]] = chat.answer([messages], 6, greedy)
    [[expected]] = tokens.answer([messages], 6, greedy)
    [[new_turn]] = tokens.answer([messages[:1]], 6, greedy)
    assert continued.text == expected.text
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered.endswith("The river")  # the turn left open: no end-of-turn, no new turn after it
    assert continued.prompt_tokens == expected.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    assert new_turn.text != continued.text


@pytest.mark.slow
def test_respond_through_the_server(server, model, tmp_path):
    from trl_longrm.datagen.expand import ExpandConfig, expand
    from trl_longrm.datagen.respond import RespondConfig, respond

    build_chat_tokenizer().save_pretrained(tmp_path / "tokenizer")
    expand(ExpandConfig(input=write_jsonl(tmp_path / "short.jsonl", short_records(2)), corpus=write_corpus(tmp_path / "c.jsonl"),
                        tokenizer=str(tmp_path / "tokenizer"), output=str(tmp_path / "long.jsonl"), target_lengths=[300]))  # fmt: skip
    spec = {"name": "served", "backend": "openai", "base_url": server.base_url, "served_model": "responder",
            "tokenizer": model}  # fmt: skip
    summary = respond(RespondConfig(input=str(tmp_path / "long.jsonl"), output=str(tmp_path / "r.jsonl"),
                                    models=[spec], num_responses=3, max_new_tokens=8))  # fmt: skip
    rows = read_jsonl(tmp_path / "r.jsonl")
    assert summary["requests"] == 2 and summary["generated_tokens"] > 0  # one request of n = 3 per record
    assert all(len(row["responses"]) <= 3 for row in rows) and any(row["responses"] for row in rows)


SCRIPT = """
import json, sys
from trl_longrm.serving import Sampling, VLLMGenerator

if __name__ == "__main__":
    engine = VLLMGenerator(sys.argv[1], dtype="float32", max_model_len=1024, gpu_memory_utilization=0.05)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    runs = [engine.sample(prompts, 6, [Sampling(n=3, seed=1), Sampling(n=2, seed=2)]) for _ in range(2)]
    alone = engine.sample(prompts[1:], 6, Sampling(n=2, seed=2))
    greedy = engine.sample(prompts[:1], 6, Sampling(n=2, temperature=0.0))[0]
    print("RESULT", json.dumps({"runs": [[[g.token_ids for g in group] for group in run] for run in runs],
                      "alone": [[g.token_ids for g in group] for group in alone],
                      "greedy": [g.token_ids for g in greedy], "generate": engine.generate(prompts[:1], 6)[0].token_ids}),
          flush=True)
"""


@pytest.mark.slow  # an in-process engine's start: about 2 min on 2 cores
def test_vllm_in_process_samples_under_each_prompts_seed(model, tmp_path):
    script = tmp_path / "sample.py"
    script.write_text(SCRIPT)
    lines = run_in_vllm_venv(script, model).stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT ") :])
    first, second = result["runs"]
    assert [len(group) for group in first] == [3, 2] and first == second
    assert result["alone"] == first[1:]  # the prompt's seed, not the batch, decides its samples
    assert result["greedy"] == [result["generate"], result["generate"]]
