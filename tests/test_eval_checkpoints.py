"""Evaluation of real-shaped checkpoints: where a DisRM is scored, checkpoints of the wrong head, prompt templates,
the room left for the judgment, and results kept per selection."""

import json

import pytest
import torch

from trl_longrm.data import scoring_ids
from trl_longrm.evaluation import (
    DiscriminativeJudge,
    EvalConfig,
    GenerativeJudge,
    JudgeRequest,
    ScriptedJudge,
    evaluate_reward_model,
    load_benchmark,
    make_toy_benchmark,
)
from trl_longrm.evaluation.templates import POINTWISE_FORMATS, PromptTemplate
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model, save_tiny_model, steer_generation


LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _tokenizer(variant):
    tokenizer = build_chat_tokenizer()
    if variant.endswith("pad_is_eos"):
        tokenizer.pad_token = tokenizer.eos_token
    elif variant == "no_pad":
        tokenizer.pad_token = None
    if variant.startswith("eot_id"):  # a Llama-3-style template: the turn ends with its EOS, no newline after it
        tokenizer.add_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], special_tokens=True)
        tokenizer.eos_token = "<|eot_id|>"
        if variant.endswith("pad_is_eos"):
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    return str(make_toy_benchmark(root, pairwise_per_task=2, bestofn_per_task=1, lengths=("4k", "8k")))


def _requests(bench, n, formats=("PairWise", "BestOfN")):
    records = load_benchmark(bench, ["LongQA", "Math"], list(formats))[:n]
    return [
        JudgeRequest(r.id, r.prompt_messages, r.task_prompt, r.candidates, ranking=r.tasktype == "BestOfN")
        for r in records
    ]


@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize("variant", ["distinct_pad", "pad_is_eos", "no_pad", "eot_id", "eot_id_pad_is_eos"])
def test_disrm_is_scored_at_the_token_training_scores(bench, variant, shared_prefix):
    """The evaluator reads each sequence's last token (the chat rendering's: ChatML's newline after the EOS, Llama-3's
    `<|eot_id|>`) by position, whatever the pad token. Stock pooling reads the same token unless the pad token is the
    sequence's last token (a Llama-3-style template with pad == EOS: a checkpoint our trainer never saves, see
    `trl_longrm.scoring`), where it reads the token before."""
    tokenizer = _tokenizer(variant)
    model = build_tiny_model("llama", "seq-cls", tokenizer).eval()
    model.config.pad_token_id = tokenizer.pad_token_id
    requests = _requests(bench, 6)
    # Padded batches of mixed lengths, or packed rows of a shared prompt and its candidates.
    judge = DiscriminativeJudge(model, tokenizer, batch_size=4, shared_prefix=shared_prefix)
    assert judge.shared_prefix == shared_prefix
    outputs = judge.judge(requests)
    stock_differs = []
    for request, output in zip(requests, outputs):
        for ids, score in zip(scoring_ids(tokenizer, request.prompt_messages, request.responses), output.scores):
            last = tokenizer.eos_token_id if variant.startswith("eot_id") else tokenizer.convert_tokens_to_ids("Ċ")
            assert ids[-1] == last  # ChatML: the newline (byte-level "Ċ") after `<|im_end|>`
            with torch.no_grad():
                # Training's score: the head at the hidden state of the sequence's last token.
                hidden = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
                reference = model.score(hidden).item()
                stock_differs.append(abs(model(torch.tensor([ids])).logits[0, 0].item() - reference) > 1e-4)
            assert score == pytest.approx(reference, abs=1e-5)
    assert all(stock_differs) if variant == "eot_id_pad_is_eos" else not any(stock_differs)


def test_checkpoint_of_the_other_head_is_refused(tmp_path, bench):
    causal = save_tiny_model(tmp_path / "causal", "qwen3", "causal-lm")
    classifier = save_tiny_model(tmp_path / "classifier", "llama", "seq-cls")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM.*without --is-disrm|Qwen3ForCausalLM.*no --is-disrm"):
        evaluate_reward_model(EvalConfig(model_path=causal, data_path=bench, is_disrm=True, save_path=str(tmp_path / "a")))
    with pytest.raises(ValueError, match="LlamaForSequenceClassification.*--is-disrm"):
        evaluate_reward_model(EvalConfig(model_path=classifier, data_path=bench, save_path=str(tmp_path / "b")))
    # Without `architectures` in its config, the missing head itself is named.
    config_path = tmp_path / "causal" / "config.json"
    config = json.loads(config_path.read_text())
    del config["architectures"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\['score.weight'\] missing"):
        evaluate_reward_model(EvalConfig(model_path=causal, data_path=bench, is_disrm=True, save_path=str(tmp_path / "c")))
    assert not (tmp_path / "c" / "predictions.jsonl").exists()


def test_grm_prompt_leaves_room_for_the_judgment(bench):
    tokenizer = build_chat_tokenizer()
    model = build_tiny_model("qwen3", "causal-lm", tokenizer)
    request = _requests(bench, 1, formats=["PairWise"])[0]
    messages = PromptTemplate.default().pairwise_messages(request.task_prompt, request.responses)
    full = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    full = full["input_ids"] if isinstance(full, dict) or hasattr(full, "keys") else full
    n = len(full)
    # Exactly room for the prompt and the judgment: nothing is cut.
    judge = GenerativeJudge(model, tokenizer, max_length=n + 5, max_new_tokens=5)
    assert judge._prompt_ids(messages) == (full, False)
    # One token short: the prompt is cut so that prompt + max_new_tokens still fit in max_length.
    judge = GenerativeJudge(model, tokenizer, max_length=n + 4, max_new_tokens=5)
    ids, cut = judge._prompt_ids(messages)
    assert cut and len(ids) == n + 4 - 5 - 5 and ids[:5] == full[:5] and ids[-5:] == full[-5:]
    # LongRM's rule ignores the judgment: a prompt of exactly max_length is cut, a shorter one kept.
    judge = GenerativeJudge(model, tokenizer, max_length=n + 1, max_new_tokens=5, evaluation_protocol="longrm")
    assert judge._prompt_ids(messages) == (full, False)
    judge = GenerativeJudge(model, tokenizer, max_length=n, max_new_tokens=5, evaluation_protocol="longrm")
    assert judge._prompt_ids(messages)[1]
    with pytest.raises(ValueError, match="max_new_tokens"):
        EvalConfig(model_path="m", data_path="d", max_length=64, max_new_tokens=64)


CUSTOM_POINTWISE = """
pointwise:
  system: "Rubric: judge faithfulness to the document. Scale {low}-{high}."
  user: "[Document and question]\\n{task}\\n[Response]\\n{response}\\nAnswer as [Analysis] ... [Score: N]."
  verdict: "[Score: N]"
"""


def test_prompt_template_file_drives_prompts_and_score_format(tmp_path, bench):
    path = tmp_path / "judge.yaml"
    path.write_text(CUSTOM_POINTWISE)
    template = PromptTemplate.from_yaml(path)
    # Sections the file leaves out keep the built-in prompts.
    assert template.pairwise == PromptTemplate.default().pairwise
    system, user = template.pointwise_messages("THE TASK", "THE RESPONSE")
    assert system["content"] == "Rubric: judge faithfulness to the document. Scale 0-10."
    assert user["content"] == "[Document and question]\nTHE TASK\n[Response]\nTHE RESPONSE\nAnswer as [Analysis] ... [Score: N]."

    tokenizer = build_chat_tokenizer()
    model = build_tiny_model("qwen3", "causal-lm", tokenizer)
    # "10" is two tokens for this tokenizer: expected scores cannot be read at one position, and we say so.
    with pytest.raises(ValueError, match="'10' is not a single token.*--no-verdict-probs"):
        GenerativeJudge(model, tokenizer, protocol="pointwise", template=template)
    judge = GenerativeJudge(model, tokenizer, protocol="pointwise", template=template, verdict_probs=False)
    seen = []

    def generate(prompts):
        texts = [tokenizer.decode(p) for p in prompts]
        seen.extend(texts)
        # The right answer quotes the document: score 10, others 3, as LongRM's judge data writes it.
        judged = ["[Analysis] fine. [Score: 10]" if "as the document states" in t else "[Analysis] no. [Score: 3]" for t in texts]
        return judged, [None] * len(judged)  # the texts, and no refusal

    judge._generate = generate
    config = EvalConfig(
        model_path="custom-judge",
        data_path=bench,
        save_path=str(tmp_path / "out"),
        judge_protocol="pointwise",
        verdict_probs=False,
        prompt_template=str(path),
        tasks=["LongQA", "Math"],
    )
    results = evaluate_reward_model(config, judge=judge)
    assert seen and all("Rubric: judge faithfulness" in t and "[Document and question]" in t for t in seen)
    assert results["pairwise_avg"] == 1.0 and results["rank_avg"] == 1.0 and results["unparseable"]["total"] == 0
    scores = [json.loads(line)["scores"] for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert sorted({s for row in scores for s in row}) == [3, 10]


def test_score_formats_parse_the_last_verdict_on_their_scale():
    bracket, tag = POINTWISE_FORMATS["[[N]]"], POINTWISE_FORMATS["[Score: N]"]
    assert tag.parse("[Analysis] The format is [Score: N]. [Score: 4] ... final [Score:10]") == 10
    assert tag.parse("[Score: 11]") is None and tag.parse("[[7]]") is None
    assert bracket.parse("[[7]] then [[ 3 ]]") == 3 and bracket.parse("[[10]]") is None


@pytest.mark.parametrize(
    "text, key",
    [
        ("judge:\n  system: x\n", "unknown section"),
        ("pairwise:\n  system: x\n  user: '{task} {responses}'\n  response: '{response}'\n  verdict: '[[A]]'\n  extra: 1\n", "pairwise.extra"),
        ("pairwise:\n  system: x\n  user: '{task}'\n  response: '{response}'\n  verdict: '[[A]]'\n", "`pairwise.user` must contain"),
        ("pairwise:\n  system: '{document}'\n  user: '{task} {responses}'\n  response: '{response}'\n  verdict: '[[A]]'\n", "`pairwise.system` uses unknown placeholder"),
        ("pointwise:\n  system: x\n  user: '{task} {response}'\n  verdict: '<<N>>'\n", "`pointwise.verdict`"),
        ("pointwise:\n  system: x\n  user: '{task} {response}'\n", "`pointwise.verdict` is missing"),
        ("ranking:\n  system: 'open {'\n  user: '{task} {responses}'\n  response: '{response}'\n  verdict: '[[A>B]]'\n", "`ranking.system` is not a valid template"),
    ],
)
def test_bad_template_names_file_and_key(tmp_path, text, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        PromptTemplate.from_yaml(path)
    assert str(path) in str(error.value) and key in str(error.value)


def test_bad_template_fails_before_any_model_loads(tmp_path, bench):
    path = tmp_path / "bad.yaml"
    path.write_text("pointwise:\n  system: x\n  user: '{task}'\n  verdict: '[[N]]'\n")
    config = EvalConfig(model_path=str(tmp_path / "no-model-here"), data_path=bench, prompt_template=str(path))
    with pytest.raises(ValueError, match="pointwise.user"):
        evaluate_reward_model(config)


def test_subset_runs_keep_their_own_results(tmp_path, bench):
    def respond(request):
        return "[[A>B]]" if request.ranking else "[[A]]"

    save = str(tmp_path / "out")
    full_judge = ScriptedJudge(respond)
    full = evaluate_reward_model(EvalConfig(model_path="s", data_path=bench, save_path=save), judge=full_judge)
    full_json = (tmp_path / "out" / "results.json").read_text()
    subset_judge = ScriptedJudge(respond)
    subset = evaluate_reward_model(
        EvalConfig(model_path="s", data_path=bench, save_path=save, tasks=["longqa"], formats=["PairWise"]),
        judge=subset_judge,
    )
    assert subset_judge.judged == []  # every record was judged by the full run
    assert (tmp_path / "out" / "results.json").read_text() == full_json
    written = json.loads((tmp_path / "out" / "results.longqa.PairWise.json").read_text())
    assert written["counts"]["records"] == subset["counts"]["records"] == full["counts"]["tasks"]["LongQA"]
    assert (tmp_path / "out" / "length_accuracy.longqa.PairWise.png").exists()


@pytest.mark.parametrize("protocol", ["pairwise", "pointwise"])
def test_verdict_probs_come_from_the_generation_pass(bench, protocol):
    tokenizer = build_chat_tokenizer()
    model = build_tiny_model("qwen3", "causal-lm", tokenizer).eval()
    script = tokenizer("Both fine.\n[[", add_special_tokens=False)["input_ids"]
    steer_generation(model, script)
    judge = GenerativeJudge(model, tokenizer, max_new_tokens=len(script) + 2, protocol=protocol)
    forced_calls = []
    forced = judge._verdict_probs
    judge._verdict_probs = lambda prompts, texts: forced_calls.append(len(prompts)) or forced(prompts, texts)
    requests = _requests(bench, 3, formats=["PairWise"])
    outputs = judge.judge(requests)  # a left-padded batch
    assert forced_calls == []  # every verdict was read from the generation pass
    # The reference: the forced-decoding pass (prompt + the judgment up to its verdict + `[[`) that the generation
    # pass replaces, one unpadded row at a time.
    for request, output in zip(requests, outputs):
        if protocol == "pairwise":
            messages = [judge.template.pairwise_messages(request.task_prompt, request.responses)]
            texts, read = [output.text], [output.verdict_probs]
        else:
            messages = [judge.template.pointwise_messages(request.task_prompt, r) for r in request.responses]
            texts, read = output.judgments, output.scores
        for message, text, value in zip(messages, texts, read):
            assert text.startswith("Both fine.\n[[")
            prompt = judge._prompt_ids(message)[0]
            [reference], _ = forced([prompt], [text])
            if protocol == "pointwise":
                reference = sum(p * v for p, v in zip(reference, judge.score_values))
            assert value == pytest.approx(reference, abs=1e-4)


def test_verdict_without_a_generated_next_step_falls_back_to_the_forced_pass(bench):
    tokenizer = build_chat_tokenizer()
    model = build_tiny_model("qwen3", "causal-lm", tokenizer).eval()
    script = tokenizer("Both fine.\n[[", add_special_tokens=False)["input_ids"]
    steer_generation(model, script)
    # The judgment stops right after `[[`: no generated step holds the verdict, so the forced pass reads it.
    judge = GenerativeJudge(model, tokenizer, max_new_tokens=len(script))
    forced_calls = []
    forced = judge._verdict_probs
    judge._verdict_probs = lambda prompts, texts: forced_calls.append(len(prompts)) or forced(prompts, texts)
    request = _requests(bench, 1, formats=["PairWise"])[0]
    [output] = judge.judge([request])
    assert output.text == "Both fine.\n[[" and forced_calls == [1]
    prompt = judge._prompt_ids(judge.template.pairwise_messages(request.task_prompt, request.responses))[0]
    assert output.verdict_probs == pytest.approx(forced([prompt], [output.text])[0][0], abs=1e-6)
    # A judgment without a verdict opening has nothing to read in the generation either.
    assert judge._probs_at_verdict([1, 2, 3], "no verdict", torch.zeros(3, 2)) is None


def test_shipped_pointwise_template_reads_longrm_judgments():
    from pathlib import Path

    from datasets import load_from_disk

    template = PromptTemplate.from_yaml(Path(__file__).resolve().parents[1] / "recipes/eval/pointwise_score.yaml")
    system, user = template.pointwise_messages("DOC AND QUESTION", "RESPONSE")
    assert "[Score: (an integer from 0 to 10)]" in system["content"] and "<response>\nRESPONSE\n</response>" in user["content"]
    sample = Path(__file__).resolve().parents[2] / "shared" / "data" / "longrm_sft_sample"
    if not sample.exists():
        pytest.skip(f"the real LongRM judge data is not present at {sample} (../shared is absent)")
    import re

    for split in load_from_disk(str(sample)).values():
        for row in split:
            # The released judgments end with `[Score: N]`; the template's format reads that N.
            expected = int(re.findall(r"\[Score: (\d+)\]", row["golden"])[-1])
            assert template.pointwise_format.parse(row["golden"]) == expected


def test_a_lora_adapter_folder_is_evaluated_on_its_base(tmp_path, bench):
    """`trl-longrm eval --model-path <adapter folder>` (what a LoRA run saves: adapter_config.json, no config.json)
    loads the base model named there with the adapter, as `AutoPeftModelForSequenceClassification` does; it failed
    with `Unrecognized model`."""
    from peft import AutoPeftModelForSequenceClassification, LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base = save_tiny_model(tmp_path / "base", "llama", "seq-cls")
    model = get_peft_model(AutoModelForSequenceClassification.from_pretrained(base),
                           LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.add_(0.05 * torch.randn_like(parameter))  # an adapter that changes the scores
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)  # no tokenizer saved: the base's is used
    assert not (adapter / "config.json").exists()
    results = evaluate_reward_model(EvalConfig(model_path=str(adapter), data_path=bench, is_disrm=True,
                                               save_path=str(tmp_path / "out"), tasks=["LongQA", "Math"]))  # fmt: skip
    predictions = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    reference = AutoPeftModelForSequenceClassification.from_pretrained(str(adapter)).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    first = predictions[0]
    record = next(r for r in load_benchmark(bench, ["LongQA", "Math"], ["PairWise", "BestOfN"]) if r.id == first["id"])
    shown = [record.candidates[i] for i in first["order"]]
    with torch.no_grad():
        expected = [reference(torch.tensor([ids])).logits[0, 0].item()
                    for ids in scoring_ids(tokenizer, record.prompt_messages, shown)]  # fmt: skip
    assert first["scores"] == pytest.approx(expected, abs=1e-4) and results["counts"]["records"] == len(predictions)
