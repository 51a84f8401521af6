"""Judges: what turns a batch of (task, displayed responses) into verdict texts or scores.

`Judge` is a protocol, so a scripted judge (fixed strings) can stand in for a model in tests. The two model-backed
judges are `GenerativeJudge` (a causal LM writing `[[A]]` / `[[C>A>B]]` verdicts, or with the pointwise protocol a
`[[7]]` score per response; greedy decoding) and `DiscriminativeJudge` (a 1-label sequence classifier scoring each
response after the prompt messages).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from trl_longrm.data.tokenization import scoring_ids
from trl_longrm.evaluation.config import JUDGE_PROTOCOLS, PROTOCOLS
from trl_longrm.evaluation.templates import PromptTemplate, label
from trl_longrm.scoring import score_index
from trl_longrm.serving.base import GenerationEngine, ScoringEngine
from trl_longrm.serving.transformers_engine import TransformersGenerator, left_padded, pad_token_id


logger = logging.getLogger(__name__)

# LongRM keeps `max_length // 2` head tokens and `max_length - max_length // 2 - 5` tail tokens of a long input.
TRUNCATION_MARGIN = 5


@dataclass
class JudgeRequest:
    """One record to judge: the task and its candidate responses in display order.

    `ranking` is True for a BestOfN record (ranking protocol) and False for a PairWise one.
    """

    record_id: str
    prompt_messages: list[dict[str, str]]
    task_prompt: str
    responses: list[str]
    ranking: bool


@dataclass
class JudgeOutput:
    """A judge's answer for one request.

    Args:
        text: verdict text of a generative judge (None for a DisRM and for the pointwise protocol).
        scores: one score per displayed response: a DisRM's, or a pointwise judge's expected score under the
            score-token probabilities (None when those were not read: the parsed scores of `judgments` then rank).
        verdict_probs: for a pairwise request of a generative judge, `[P(A), P(B)]` normalised over the two letters
            at the verdict position, or None when not computed.
        judgments: the pointwise judge's text for each displayed response (None for other judges); a record whose
            judgments do not all end with a score counts as unparseable.
        truncated: whether any model input of this request was cut to its head and tail.
        bounded_verdict_probs: how many of this request's verdict probabilities are bounds, not exact: the engine
            (a server returning only its top-k log-probabilities) did not report every verdict token
            (`GenerativeJudge._verdict_probs`).
        refusal: why the engine refused (one of) this request's prompts, with `GenerativeJudge(refusals="keep")`:
            that prompt has no text (its `text`, or its entry of `judgments`, is None) and no verdict probabilities.
    """

    text: str | None = None
    scores: list[float] | None = None
    verdict_probs: list[float] | None = None
    judgments: list[str] | None = None
    truncated: bool = False
    bounded_verdict_probs: int = 0
    refusal: str | None = None


@dataclass
class RenderedPrompts:
    """A generative judge's prompts for some requests, as token ids (`GenerativeJudge.render`): `truncated[k]` whether
    prompt k was cut, `owners[k]` the request it belongs to (pointwise: one prompt per response)."""

    prompts: list[list[int]]
    truncated: list[bool]
    owners: list[int]


@runtime_checkable
class Judge(Protocol):
    """Anything with a `model_type` (`"GRM"` or `"DisRM"`) and a batched `judge` method.

    Example (a scripted judge that always prefers the first response):
    ```python
    >>> class AlwaysA:
    ...     model_type = "GRM"
    ...     def judge(self, requests):
    ...         return [JudgeOutput(text="[[A]]" if not r.ranking else "[[A>B]]") for r in requests]
    ```
    """

    model_type: str

    def judge(self, requests: Sequence[JudgeRequest]) -> list[JudgeOutput]: ...


class ScriptedJudge:
    """A judge answering from a function of the request (or a dict keyed by record id) instead of a model.

    Useful to test the pipeline, or to score verdicts produced elsewhere (e.g. by an API judge). A plain string
    answer becomes `JudgeOutput(text=...)`. `judged` lists the record ids in the order they were judged.

    Example:
    ```python
    >>> judge = ScriptedJudge(lambda request: "[[B>A]]" if request.ranking else "[[A]]")
    >>> judge.judge([JudgeRequest("x/1", [], "task", ["a", "b"], ranking=False)])[0].text
    '[[A]]'
    ```
    """

    def __init__(
        self,
        respond: Callable[[JudgeRequest], JudgeOutput | str] | Mapping[str, JudgeOutput | str],
        model_type: str = "GRM",
    ):
        self.respond = respond.__getitem__ if isinstance(respond, Mapping) else respond
        self.respond_by_id = isinstance(respond, Mapping)
        self.model_type = model_type
        self.judged: list[str] = []

    def judge(self, requests: Sequence[JudgeRequest]) -> list[JudgeOutput]:
        outputs = []
        for request in requests:
            answer = self.respond(request.record_id if self.respond_by_id else request)
            outputs.append(JudgeOutput(text=answer) if isinstance(answer, str) else answer)
            self.judged.append(request.record_id)
        return outputs


def truncate_head_tail(ids: list[int], max_length: int, at_limit: bool = False) -> tuple[list[int], bool]:
    """Keep the first `max_length // 2` and last `max_length - max_length // 2 - 5` tokens of an over-long input.

    An input is over-long when it has more than `max_length` tokens, or with `at_limit=True` (LongRM's evaluator,
    the `longrm` protocol) when it has at least `max_length`.

    Example:
    ```python
    >>> truncate_head_tail(list(range(40)), 20)
    ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 35, 36, 37, 38, 39], True)
    ```
    """
    if len(ids) < max_length or (len(ids) == max_length and not at_limit):
        return ids, False
    head = max_length // 2
    tail = max_length - head - TRUNCATION_MARGIN
    return ids[:head] + ids[len(ids) - tail :], True


def _resolve_device(device: str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _resolve_dtype(dtype: str):
    return "auto" if dtype == "auto" else getattr(torch, dtype)


_HEADS = {"causal-lm": ("ForCausalLM", "--is-disrm"), "seq-cls": ("ForSequenceClassification", "no --is-disrm")}


def _adapter_base(model_path: str) -> str | None:
    """The base model of a PEFT adapter folder (`adapter_config.json` and no `config.json`), else None."""
    import json
    from pathlib import Path

    folder = Path(model_path)
    if not (folder / "adapter_config.json").is_file() or (folder / "config.json").is_file():
        return None
    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{model_path} is a PEFT adapter whose adapter_config.json names no `base_model_name_or_path`; evaluate "
            "the base model merged with it (`save_merged_model: true` in the recipe)."
        )
    return base


def load_tokenizer(model_path: str):
    """The tokenizer of a checkpoint, or of an adapter folder's base model when the folder has none."""

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):
        base = _adapter_base(model_path)
        if base is None:
            raise
        return AutoTokenizer.from_pretrained(base)


def _load_checked(auto_class, model_path: str, dtype: str, kind: str):
    """Load `model_path` with `auto_class`, refusing a checkpoint of the other head (`kind`: `causal-lm` for a
    generative judge, `seq-cls` for a DisRM): its missing head would be initialised at random and every score or
    verdict would be noise. A PEFT adapter folder (what a LoRA run saves) is loaded onto its base model and merged,
    as `AutoPeftModel*` loads it."""
    from transformers import AutoConfig

    base = _adapter_base(model_path)
    if base is not None:
        from peft import PeftModel

        if not Path(base).exists() and Path(base).is_absolute():
            raise ValueError(f"{model_path} is a PEFT adapter of {base}, which is not there; pass the base model's "
                             "path in its adapter_config.json.")  # fmt: skip
        extra = {"num_labels": 1} if kind == "seq-cls" else {}
        model = auto_class.from_pretrained(base, dtype=_resolve_dtype(dtype), **extra)
        return PeftModel.from_pretrained(model, model_path).merge_and_unload()

    suffix, hint = _HEADS[kind]
    other = next(v for k, v in _HEADS.items() if k != kind)[0]
    architectures = AutoConfig.from_pretrained(model_path).architectures or []
    if architectures and all(a.endswith(other) for a in architectures):
        raise ValueError(
            f"{model_path} is a {', '.join(architectures)} checkpoint, but the evaluation loads it as a *{suffix} "
            f"model; evaluate it with {hint}."
        )
    model, info = auto_class.from_pretrained(model_path, dtype=_resolve_dtype(dtype), output_loading_info=True)
    if info["missing_keys"]:
        raise ValueError(
            f"{model_path}: loading it as a *{suffix} model leaves the weights {sorted(info['missing_keys'])} missing "
            f"from the checkpoint (they would be random). Evaluate a model trained with that head, or with {hint}."
        )
    return model


def _chat_ids(
    tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool, continue_final_message: bool = False
) -> list[int]:
    if not tokenizer.chat_template:
        raise ValueError(
            f"The tokenizer of {tokenizer.name_or_path!r} has no chat template; the judge needs one to format prompts."
        )
    # `enable_thinking=False` turns off the thinking block of templates that have one (Qwen3); others ignore it.
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        enable_thinking=False,
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


_pad = left_padded
_pad_token_id = pad_token_id


class GenerativeJudge:
    """A causal LM judge: greedy, batched (left-padded) generation of a verdict per request.

    Prompts come from `template` (a `PromptTemplate`; default the built-in prompts). In the default evaluation
    protocol a prompt is cut to head + tail so that it leaves room for the judgment: prompt + `max_new_tokens` fit in
    `max_length`. With `evaluation_protocol="longrm"` the cut is LongRM's: a prompt of at least `max_length` tokens
    keeps its first `max_length // 2` and last `max_length - max_length // 2 - 5`.

    With `verdict_probs=True` each pairwise request also gets one forced-decoding pass: the prompt, the judge's own
    output up to its verdict (all of it when it wrote none), then `[[`; the next-token probabilities of `A` and `B`
    there, renormalised over the two, are `JudgeOutput.verdict_probs`.

    With `protocol="pointwise"` the judge writes one judgment per response (the template's pointwise prompt), ending
    with a score in the template's verdict format (`[[N]]` on 0..9 by default, or `[Score: N]` on 0..10); the record's
    ranks follow from the scores. With `verdict_probs=True` the score of a response is its expected score: the same
    forced-decoding pass (up to the verdict's opening, e.g. `[[`) reads the probabilities of the score tokens,
    renormalised over them, so that two responses given the same integer score are still ordered (and the AUC has
    continuous scores); every score must then be one token. Otherwise it is the parsed integer (ties keep display
    order).

    `model` is a transformers causal LM (generated from with `generate`) or a `GenerationEngine` (`trl_longrm.serving`:
    `VLLMGenerator` in process, `OpenAIGenerator` for an OpenAI-compatible server): prompts, their cut and the reading
    of verdicts are the same whatever generates.

    A prompt the engine refuses (a server's 4xx) raises an `EngineError` (`refusals="raise"`, the evaluation's), or
    with `refusals="keep"` leaves that request's output without text, its `refusal` saying why (`JudgeReward`).

    Example:
    ```python
    >>> judge = GenerativeJudge.from_pretrained("./LongReward_Qwen3-8B", max_length=131072, max_new_tokens=2048)
    >>> out = judge.judge([JudgeRequest("x/1", msgs, "task text", ["resp 1", "resp 2"], ranking=False)])
    >>> out[0].text, out[0].verdict_probs
    ```
    """

    model_type = "GRM"

    def __init__(
        self,
        model,
        tokenizer,
        max_length: int = 131072,
        max_new_tokens: int = 2048,
        verdict_probs=True,
        protocol: str = "pairwise",
        template: PromptTemplate | None = None,
        evaluation_protocol: str = "default",
        refusals: str = "raise",
    ):
        if refusals not in ("raise", "keep"):
            raise ValueError(f"`refusals` must be 'raise' or 'keep', got {refusals!r}.")
        if protocol not in JUDGE_PROTOCOLS:
            raise ValueError(f"`protocol` must be one of {list(JUDGE_PROTOCOLS)}, got {protocol!r}.")
        if evaluation_protocol not in PROTOCOLS:
            raise ValueError(f"`evaluation_protocol` must be one of {list(PROTOCOLS)}, got {evaluation_protocol!r}.")
        if evaluation_protocol == "default" and max_new_tokens >= max_length:
            raise ValueError(
                f"`max_new_tokens` ({max_new_tokens}) leaves no room for the prompt in `max_length` ({max_length})."
            )
        # A transformers model runs through `generate`; an engine (in-process vLLM, an OpenAI-compatible server) is
        # used as it is. The prompts, their cut and the reading of verdicts are the judge's, whatever the engine.
        if isinstance(model, GenerationEngine):
            self.engine, self.model = model, getattr(model, "model", None)
        else:
            self.engine, self.model = TransformersGenerator(model, tokenizer), model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_new_tokens = max_new_tokens
        self.verdict_probs = verdict_probs
        self.protocol = protocol
        self.template = template or PromptTemplate.default()
        self.evaluation_protocol = evaluation_protocol
        self.refusals = refusals
        score_format = self.template.pointwise_format
        low, high = score_format.scale
        self.score_values = list(range(low, high + 1))
        # Pairwise verdicts are read at the letters A and B after `[[`, pointwise scores at the score tokens after the
        # verdict's opening.
        self.verdict_prefix = "[[" if protocol == "pairwise" else score_format.prefix
        self.forced_ids = tokenizer(self.verdict_prefix, add_special_tokens=False)["input_ids"]
        verdicts = [label(p) for p in range(2)] if protocol == "pairwise" else [str(v) for v in self.score_values]
        self.verdict_ids = []
        for verdict in verdicts if verdict_probs else []:
            ids = tokenizer(verdict, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(
                    f"Verdict {verdict!r} is not a single token ({ids}) for this tokenizer, so its probability cannot "
                    "be read at one position; evaluate with --no-verdict-probs (scores are then the parsed ones)."
                )
            self.verdict_ids.append(ids[0])
        # A running count over the judge's calls (the evaluation's report); the lock keeps it exact under concurrent calls.
        self.bounded_verdict_probs = 0
        self._count_lock = threading.Lock()

    @classmethod
    def from_pretrained(cls, model_path: str, device: str | None = None, dtype: str = "auto", **kwargs):
        """Load the judge's causal LM and tokenizer from a local directory."""
        tokenizer = load_tokenizer(model_path)
        model = _load_checked(AutoModelForCausalLM, model_path, dtype, "causal-lm")
        return cls(model.to(_resolve_device(device)), tokenizer, **kwargs)

    def _prompt_ids(self, messages: list[dict[str, str]]) -> tuple[list[int], bool]:
        ids = _chat_ids(self.tokenizer, messages, add_generation_prompt=True)
        if self.evaluation_protocol == "longrm":
            ids, cut = truncate_head_tail(ids, self.max_length, at_limit=True)
            if cut:
                # LongRM's seam: its evaluator decodes the cut ids to text and its engine tokenizes that text again, so
                # a cut inside a multi-byte character becomes U+FFFD and then its own ids (one to three differ).
                ids = self.tokenizer(self.tokenizer.decode(ids), add_special_tokens=False)["input_ids"]
            return ids, cut
        # The judgment must fit in the context too.
        return truncate_head_tail(ids, self.max_length - self.max_new_tokens)

    def _budgets(self, prompts: list[list[int]]) -> list[int] | None:
        """Under `evaluation_protocol="longrm"`, each prompt's new-token budget as LongRM's vLLM call gives it: its
        engine sets no `max_model_len` (the model's own length), so a prompt cut to `max_length - 5` tokens keeps only
        what the model's length leaves (`max_new_tokens` at most). None when every prompt gets `max_new_tokens` (the
        default protocol cuts prompts to leave it) or the model's length is unknown."""
        if self.evaluation_protocol != "longrm":
            return None
        limit = getattr(self.engine, "max_model_len", None)
        if limit is None and isinstance(self.engine, TransformersGenerator):
            # What vLLM derives for the same checkpoint (its `max_model_len` default).
            limit = getattr(self.engine.model.config, "max_position_embeddings", None)
        if limit is None:
            return None
        # A prompt as long as the model itself is left to the engine, which refuses it (as LongRM's run would fail).
        budgets = [min(self.max_new_tokens, limit - len(p)) if len(p) < limit else self.max_new_tokens for p in prompts]
        return None if all(b == self.max_new_tokens for b in budgets) else budgets

    def _generate(self, prompts: list[list[int]], read_verdicts: bool = False):
        """Greedy judgments of `prompts`: their texts (None where the engine refused the prompt) and the engine's
        refusals (None where it generated), and with `read_verdicts` also, per row, the probabilities of the verdict
        tokens at the step after the verdict's opening, read from the generation's own log-probabilities (None where
        the judgment has no verdict opening, it does not end on a token boundary, or the engine did not report every
        verdict token there). Everything a call learns is returned, nothing kept on the judge: one judge serves
        concurrent calls (the reward server judges several groups at once)."""
        asked = self.verdict_ids if read_verdicts else None
        budgets = self._budgets(prompts)
        if budgets is None:
            generations = self.engine.generate(prompts, self.max_new_tokens, logprob_token_ids=asked)
        else:  # one call per budget (few distinct ones: only prompts near the model's length get less)
            generations = [None] * len(prompts)
            for budget in sorted(set(budgets)):
                rows = [i for i, b in enumerate(budgets) if b == budget]
                for i, generation in zip(rows, self.engine.generate([prompts[i] for i in rows], budget, asked)):
                    generations[i] = generation
        refusals = [getattr(g, "refusal", None) for g in generations]
        refused = next((reason for reason in refusals if reason), None)
        if refused and self.refusals == "raise":
            from trl_longrm.serving.base import EngineError

            raise EngineError(refused)
        texts = [None if reason else self._decode(g.token_ids) for g, reason in zip(generations, refusals)]
        if not read_verdicts:
            return texts, refusals
        probs = [
            None if text is None else self._probs_at_verdict(g.token_ids, text, g.logprobs)
            for g, text in zip(generations, texts)
        ]
        return texts, refusals, probs

    def _decode(self, token_ids: list[int]) -> str:
        """A judgment's text. Under `evaluation_protocol="longrm"`, as vLLM's detokenizer ends it (LongRM stores the
        engine's text): its incremental decoding (tokenizers' `DecodeStream`) emits nothing for bytes that do not yet
        make a character, so a judgment stopping inside a multi-byte character ends before it, without U+FFFD."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return text.rstrip("\ufffd") if self.evaluation_protocol == "longrm" else text

    def _probs_at_verdict(self, tokens: list[int], text: str, step_logprobs) -> list[float] | None:
        start = text.find(self.verdict_prefix)
        if start < 0:
            return None
        target = text[: start + len(self.verdict_prefix)]

        def decoded(n):
            return self.tokenizer.decode(tokens[:n], skip_special_tokens=True)

        # The fewest generated tokens whose text reaches the end of the verdict's opening.
        low, high = 1, len(tokens)
        while low < high:
            middle = (low + high) // 2
            if len(decoded(middle)) >= len(target):
                high = middle
            else:
                low = middle + 1
        if low >= len(step_logprobs) or decoded(low) != target:
            return None  # the opening shares a token with what follows: the forced pass reads it instead
        step = step_logprobs[low]
        if any(token not in step for token in self.verdict_ids):
            return None  # the engine reported only its top tokens: the forced pass reads them
        return torch.tensor([step[token] for token in self.verdict_ids]).softmax(dim=-1).tolist()

    def _read_verdicts(self, prompts: list[list[int]], wanted: list[bool] | None = None):
        """Texts, refusals, the verdict probabilities of the `wanted` rows (default all; None for the others): from the
        generation pass where it can, else from a forced pass; and per row whether its probabilities are bounds."""
        texts, refusals, probs = self._generate(prompts, read_verdicts=True)
        # A refused prompt has no judgment to read a verdict from.
        wanted = [text is not None and want for text, want in zip(texts, wanted or [True] * len(prompts))]
        probs = [p if want else None for p, want in zip(probs, wanted)]
        bounded = [False] * len(prompts)
        missing = [i for i, p in enumerate(probs) if p is None and wanted[i]]
        if missing:
            forced, flags = self._verdict_probs([prompts[i] for i in missing], [texts[i] for i in missing])
            for i, p, flag in zip(missing, forced, flags):
                probs[i], bounded[i] = p, flag
        return texts, refusals, probs, bounded

    def render(self, requests: Sequence[JudgeRequest]) -> RenderedPrompts:
        """The requests' prompts as the engine gets them (rendered, tokenized, cut), without generating: `judge`'s
        first half, for a caller that prepares requests before it may send them (the reward server renders a group
        while it waits for room under its limit of requests in flight)."""
        prompts, truncated, owners = [], [], []
        for i, request in enumerate(requests):
            if self.protocol == "pointwise":  # one judgment per (request, response)
                messages = [self.template.pointwise_messages(request.task_prompt, r) for r in request.responses]
            elif request.ranking:
                messages = [self.template.ranking_messages(request.task_prompt, request.responses)]
            else:
                messages = [self.template.pairwise_messages(request.task_prompt, request.responses)]
            for message in messages:
                ids, cut = self._prompt_ids(message)
                prompts.append(ids)
                truncated.append(cut)
                owners.append(i)
        return RenderedPrompts(prompts, truncated, owners)

    def judge(self, requests: Sequence[JudgeRequest], rendered: RenderedPrompts | None = None) -> list[JudgeOutput]:
        """One `JudgeOutput` per request; `rendered` is `render(requests)` when the caller made it already."""
        rendered = rendered if rendered is not None else self.render(requests)
        if self.protocol == "pointwise":
            return self._judge_pointwise(requests, rendered)
        prompts, truncated = rendered.prompts, rendered.truncated
        wanted = [self.verdict_probs and not request.ranking for request in requests]
        if any(wanted):
            texts, refusals, probs, bounded = self._read_verdicts(prompts, wanted)
        else:
            (texts, refusals), probs, bounded = self._generate(prompts), [None] * len(prompts), [False] * len(prompts)
        return [
            JudgeOutput(text=text, truncated=cut, verdict_probs=p, bounded_verdict_probs=int(b), refusal=reason)
            for text, cut, p, b, reason in zip(texts, truncated, probs, bounded, refusals)
        ]

    def _judge_pointwise(self, requests: Sequence[JudgeRequest], rendered: RenderedPrompts) -> list[JudgeOutput]:
        # One judgment per (request, response), generated in one batch.
        prompts, owners, truncated = rendered.prompts, rendered.owners, [False] * len(requests)
        for owner, cut in zip(owners, rendered.truncated):
            truncated[owner] = truncated[owner] or cut
        bounded = [False] * len(prompts)
        if self.verdict_probs:
            texts, refusals, probs, bounded = self._read_verdicts(prompts)
        else:
            # The runner then ranks by the judgments' parsed scores.
            (texts, refusals), probs = self._generate(prompts), None
        outputs = [JudgeOutput(judgments=[], truncated=cut) for cut in truncated]
        for owner, text, b, reason in zip(owners, texts, bounded, refusals):
            outputs[owner].judgments.append(text)
            outputs[owner].bounded_verdict_probs += int(b)
            outputs[owner].refusal = outputs[owner].refusal or reason
        if probs is not None:
            values = torch.tensor(self.score_values, dtype=torch.float)
            for output in outputs:
                output.scores = []
            for owner, p in zip(owners, probs):
                outputs[owner].scores.append(None if p is None else float(torch.tensor(p) @ values))
        return outputs

    def _verdict_probs(self, prompts: list[list[int]], texts: list[str]) -> list[list[float]]:
        """The forced-decoding pass: the next-token probabilities of the verdict tokens after prompt + the judgment up
        to its verdict + the verdict's opening, renormalised over them. A verdict token the engine does not report (a
        server returning only its top-k log-probabilities) is given the lowest log-probability reported at that step,
        an upper bound; such requests are counted in `bounded_verdict_probs` and flagged, per row of this call, in the
        second list returned (from which each `JudgeOutput` counts its own)."""
        rows = []
        limit = self.max_length if self.evaluation_protocol == "default" else getattr(self.engine, "max_model_len", None)
        for prompt, text in zip(prompts, texts):
            # Reasoning up to the verdict stays in context, so the probe reads the judgment at its own verdict spot.
            start = text.find(self.verdict_prefix)
            reasoning = text[:start] if start >= 0 else text
            reasoning_ids = self.tokenizer(reasoning, add_special_tokens=False)["input_ids"] if reasoning else []
            if limit is not None:
                # Re-tokenized, a judgment may take more tokens than were generated (a partial character's U+FFFD):
                # its end is dropped so that the pass fits the context the judgment was generated in.
                reasoning_ids = reasoning_ids[: max(limit - 1 - len(prompt) - len(self.forced_ids), 0)]
            rows.append(prompt + reasoning_ids + self.forced_ids)
        probs, bounded = [], []
        for generation in self.engine.generate(rows, 1, logprob_token_ids=self.verdict_ids):
            if getattr(generation, "refusal", None):
                if self.refusals == "raise":
                    from trl_longrm.serving.base import EngineError

                    raise EngineError(generation.refusal)
                bounded.append(False)
                probs.append(None)
                continue
            step = generation.logprobs[0]
            bounded.append(any(token not in step for token in self.verdict_ids))
            if bounded[-1]:
                with self._count_lock:
                    self.bounded_verdict_probs += 1
                floor = min(step.values(), default=0.0)
                step = {token: step.get(token, floor) for token in self.verdict_ids}
            # Renormalised over the verdict tokens (A/B, or the score tokens) at the position after the opening.
            probs.append(torch.tensor([step[token] for token in self.verdict_ids]).softmax(dim=-1).tolist())
        return probs, bounded


class DiscriminativeJudge:
    """A 1-label sequence-classification RM: each response is scored as the prompt messages plus an assistant turn.

    The scored sequence is the one the DisRM trainers train on (`trl_longrm.data.scoring_ids`): the prompt rendered
    with the generation prompt, then the response up to and including the EOS token. The score is read at exactly that
    last token, as training reads it (`trl_longrm.heads.add_last_token_score_head`), whatever the tokenizer's pad
    token: the stock classification head pools the last token that is not the pad id, which is the token *before* the
    EOS when pad == EOS (a common setting for models without a pad token).

    With `shared_prefix` (default), the candidates of a record are laid out as their longest common token prefix (the
    prompt) once, then each candidate's remaining tokens, in one packed row of `batch_size` records attended by the
    `"longrm_ring"` attention (each candidate sees the prefix and itself only, positions continuing the prefix): the
    scores of scoring each candidate alone, the prompt encoded once. Otherwise sequences are right-padded (natural
    position ids, as in reward-model training) and scored `batch_size` at a time. With `evaluation_protocol="longrm"`
    a sequence of at least `max_length` tokens is cut (LongRM's rule), else only a longer one.

    `model` may also be a `ScoringEngine` (`trl_longrm.serving`: vLLM's pooling runner in process, or a server's
    `/classify`), which scores the same sequences at the same last token.

    Example:
    ```python
    >>> judge = DiscriminativeJudge.from_pretrained("./LongReward_Skywork-Reward-V2-Llama-3.1-8B", batch_size=4)
    >>> judge.judge([JudgeRequest("x/1", msgs, "task text", ["resp 1", "resp 2"], ranking=False)])[0].scores
    ```
    """

    model_type = "DisRM"

    def __init__(
        self,
        model,
        tokenizer,
        max_length: int = 131072,
        batch_size: int = 1,
        shared_prefix: bool = True,
        evaluation_protocol: str = "default",
        max_tokens_per_row: int | None = None,
    ):
        if evaluation_protocol not in PROTOCOLS:
            raise ValueError(f"`evaluation_protocol` must be one of {list(PROTOCOLS)}, got {evaluation_protocol!r}.")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.at_limit = evaluation_protocol == "longrm"
        self.max_tokens_per_row = max_tokens_per_row
        # An engine (vLLM's pooling runner, in process or behind `/classify`) scores each sequence as it is given: the
        # sequences and their last tokens are the judge's.
        self.engine = model if isinstance(model, ScoringEngine) else None
        self.shared_prefix = shared_prefix and self.engine is None
        if self.engine is not None:
            self.model = None
            return
        if model.config.num_labels != 1:
            raise ValueError(f"A DisRM must have exactly 1 output label, got num_labels={model.config.num_labels}.")
        from trl_longrm.heads import add_last_token_score_head

        self.model = model.eval()
        add_last_token_score_head(self.model)
        if self.shared_prefix:
            from trl_longrm.sequence_parallel import validate_ring_attention_model

            try:
                validate_ring_attention_model(self.model)
            except (TypeError, NotImplementedError, ValueError) as error:
                # Same scores either way: only the cost differs, so say why and score unshared.
                logger.warning("Scoring candidates without a shared prefix: %s", error)
                self.shared_prefix = False
        self.pad_id = _pad_token_id(tokenizer)

    @classmethod
    def from_pretrained(cls, model_path: str, device: str | None = None, dtype: str = "auto", **kwargs):
        """Load the sequence classifier and tokenizer from a local directory."""
        tokenizer = load_tokenizer(model_path)
        model = _load_checked(AutoModelForSequenceClassification, model_path, dtype, "seq-cls")
        return cls(model.to(_resolve_device(device)), tokenizer, **kwargs)

    def _shared_scores(self, records: list[list[list[int]]]) -> list[float]:
        """Scores of the candidate sequences of `records` (one list of sequences per record), in order: up to
        `batch_size` records per shared-prefix row, and at most `max_tokens_per_row` tokens in a row (a record over
        it is split into several, each with its prefix)."""
        from trl_longrm.sequence_parallel import RING_META_KWARG, register_ring_attention
        from trl_longrm.sequence_parallel.sharding import shared_row_metadata

        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        original = base.config._attn_implementation
        scores = []
        try:
            # Only our attention reads the row's documents from the metadata; switched back afterwards so that the
            # caller's model is left as it was.
            base.set_attn_implementation(register_ring_attention())
            for row_records in plan_shared_rows(records, self.batch_size, self.max_tokens_per_row):
                row = _shared_prefix_row(row_records)
                meta = shared_row_metadata(row["segment_lengths"], row["segment_parents"])
                output = self.model(
                    input_ids=row["input_ids"].to(self.model.device),
                    position_ids=row["position_ids"].to(self.model.device),
                    score_positions=row["score_positions"].to(self.model.device),
                    use_cache=False,
                    **{RING_META_KWARG: meta},
                )
                scores.extend(output.scores.float().cpu().tolist())
        finally:
            base.set_attn_implementation(original)
        return scores

    @torch.no_grad()
    def score_sequences(self, records: list[list[list[int]]]) -> list[float]:
        """Scores of token sequences as they are (no truncation), each read at its last token: `records` holds the
        sequences of one prompt each (the prompt is encoded once per row under `shared_prefix`). Flat, in order.

        An empty sequence has no last token, so no score: it is refused (scored in a packed or padded batch, it would
        be read at a neighbour's token)."""
        for r, record in enumerate(records):
            for s, sequence in enumerate(record):
                if not sequence:
                    raise ValueError(
                        f"Sequence {s} of record {r} is empty: a reward model's score is read at a sequence's last "
                        "token, and it has none."
                    )
        sequences = [sequence for record in records for sequence in record]
        if self.engine is not None:
            return self.engine.score(sequences)
        if self.shared_prefix:
            return self._shared_scores(records)
        scores = []
        for start in range(0, len(sequences), self.batch_size):
            rows = sequences[start : start + self.batch_size]
            input_ids, attention_mask = _pad(rows, self.pad_id, left=False)
            # Flat index of each row's last real token in the [rows * width] batch: the token training scores.
            last = torch.tensor([r * input_ids.shape[1] + score_index(len(row)) for r, row in enumerate(rows)])
            device = self.model.device
            out = self.model(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                score_positions=last.to(device),
            )
            scores.extend(out.scores.float().cpu().tolist())
        return scores

    @torch.no_grad()
    def judge(self, requests: Sequence[JudgeRequest]) -> list[JudgeOutput]:
        owners, truncated = [], [False] * len(requests)
        records: list[list[list[int]]] = []
        for i, request in enumerate(requests):
            records.append([])
            # The sequences the DisRM trainers score: the conversation as the chat template renders it.
            for full in scoring_ids(self.tokenizer, request.prompt_messages, request.responses):
                ids, cut = truncate_head_tail(full, self.max_length, at_limit=self.at_limit)
                records[-1].append(ids)
                owners.append(i)
                truncated[i] = truncated[i] or cut
        outputs = [JudgeOutput(scores=[], truncated=cut) for cut in truncated]
        for owner, score in zip(owners, self.score_sequences(records)):
            outputs[owner].scores.append(score)
        return outputs


def plan_shared_rows(
    records: list[list[list[int]]], max_records: int, max_tokens: int | None = None
) -> list[list[list[list[int]]]]:
    """The records of each shared-prefix row, in order: at most `max_records` per row and `max_tokens` tokens (each
    record's common prefix once plus its sequences' remaining tokens); a record that alone exceeds `max_tokens` is
    split into parts of consecutive sequences, each part with its prefix (a single sequence may exceed it).

    Example:
    ```python
    >>> plan_shared_rows([[[1, 2, 3], [1, 2, 4]], [[5, 6]]], max_records=8, max_tokens=5)
    [[[[1, 2, 3], [1, 2, 4]]], [[[5, 6]]]]
    ```
    """
    def cost(record):
        shared = _common_prefix_length(record) if len(record) > 1 else 0
        return shared + sum(len(sequence) - shared for sequence in record)

    parts = []
    for record in records:
        if max_tokens is None or cost(record) <= max_tokens:
            parts.append(record)
            continue
        part = []
        for sequence in record:
            if part and cost(part + [sequence]) > max_tokens:
                parts.append(part)
                part = []
            part.append(sequence)
        parts.append(part)
    rows, row, tokens = [], [], 0
    for part in parts:
        if row and (len(row) == max_records or (max_tokens is not None and tokens + cost(part) > max_tokens)):
            rows.append(row)
            row, tokens = [], 0
        row.append(part)
        tokens += cost(part)
    if row:
        rows.append(row)
    return rows


def _common_prefix_length(sequences: list[list[int]]) -> int:
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        token = sequences[0][i]
        if any(s[i] != token for s in sequences[1:]):
            return i
    return shortest


def _shared_prefix_row(records: list[list[list[int]]]) -> dict[str, torch.Tensor]:
    """One packed row: each record's longest common token prefix once, then each candidate's remaining tokens
    (positions continuing the prefix's), with the segments, their prefixes and each candidate's last-token index."""
    input_ids, position_ids, lengths, parents, score_positions = [], [], [], [], []
    for sequences in records:
        shared = _common_prefix_length(sequences) if len(sequences) > 1 else 0
        prefix_segment, prefix_end = -1, len(input_ids)
        if shared:
            prefix_segment = len(lengths)
            input_ids.extend(sequences[0][:shared])
            position_ids.extend(range(shared))
            lengths.append(shared)
            parents.append(-1)
            prefix_end = len(input_ids)
        for sequence in sequences:
            rest = sequence[shared:]
            if rest:
                input_ids.extend(rest)
                position_ids.extend(range(shared, len(sequence)))
                lengths.append(len(rest))
                parents.append(prefix_segment)
                score_positions.append(len(input_ids) - 1)
            else:  # the candidate is the common prefix itself: its last token is the prefix's (an empty candidate,
                # which would get the previous record's last token, is refused by `score_sequences`)
                score_positions.append(prefix_end - 1)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return {
        "input_ids": as_tensor(input_ids).unsqueeze(0),
        "position_ids": as_tensor(position_ids).unsqueeze(0),
        "segment_lengths": as_tensor(lengths),
        "segment_parents": as_tensor(parents),
        "score_positions": as_tensor(score_positions),
    }


def load_judge(
    model_path: str,
    is_disrm: bool = False,
    max_length: int = 131072,
    max_new_tokens: int = 2048,
    batch_size: int = 1,
    device: str | None = None,
    dtype: str = "auto",
    verdict_probs: bool = True,
    judge_protocol: str = "pairwise",
    shared_prefix: bool = True,
    protocol: str = "default",
    template: PromptTemplate | None = None,
) -> Judge:
    """A `DiscriminativeJudge` (`is_disrm=True`) or `GenerativeJudge` (judging with `judge_protocol` and the prompts
    of `template`) loaded from a local model directory; `protocol` is the evaluation protocol (`default` or `longrm`).

    Example:
    ```python
    >>> judge = load_judge("./my_disrm", is_disrm=True, max_length=32768)
    ```
    """
    if is_disrm:
        return DiscriminativeJudge.from_pretrained(
            model_path,
            device=device,
            dtype=dtype,
            max_length=max_length,
            batch_size=batch_size,
            shared_prefix=shared_prefix,
            evaluation_protocol=protocol,
        )
    return GenerativeJudge.from_pretrained(
        model_path,
        device=device,
        dtype=dtype,
        max_length=max_length,
        max_new_tokens=max_new_tokens,
        verdict_probs=verdict_probs,
        protocol=judge_protocol,
        template=template,
        evaluation_protocol=protocol,
    )
