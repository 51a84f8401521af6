"""A judge whose verdicts depend on what it reads, for tests: a vLLM logits processor (loaded by a real vLLM server
with `--logits-processors judge_steering:SteeredVerdicts`, this folder on its PYTHONPATH) that makes the served model
write, for each prompt, the verdict a fixed rule gives on the responses it shows, and the same rule by hand.

The rule: a response's quality is `quality(text)` (a CRC of its text without whitespace: distinct responses almost surely differ); a
pairwise prompt gets `[[A]]` or `[[B]]` for the better one (no verdict for equal texts), a ranking prompt the labels
from best to worst, a pointwise prompt `[[quality % 10]]`. The prompts are read as the built-in template lays them out
(`# Response X` ... `# End of Response X`).
"""

from __future__ import annotations

import re
import zlib
from itertools import permutations


_RESPONSE = re.compile(r"# Response(?: ([A-Z]))?\n(.*?)\n# End of Response", re.S)


def quality(text: str) -> int:
    # Without whitespace: a text decoded from the prompt's token ids may differ from the original in its spaces.
    return zlib.crc32("".join(text.split()).encode("utf-8"))


def verdict_for(prompt_text: str) -> str:
    """The verdict the steered judge writes for a rendered prompt (its last user turn's responses)."""
    user = prompt_text.rsplit("# Task", 1)[-1]
    found = _RESPONSE.findall(user)
    if not found:
        return "no verdict"
    if len(found) == 1 and not found[0][0]:  # pointwise: one unlabelled response
        return f"[[{quality(found[0][1]) % 10}]]"
    labels = [label for label, _ in found]
    scores = {label: quality(text) for label, text in found}
    if "Rank the responses" in user:
        return "[[" + ">".join(sorted(labels, key=lambda label: -scores[label])) + "]]"
    a, b = labels[:2]
    if scores[a] == scores[b]:
        return "no verdict"
    return f"[[{a if scores[a] > scores[b] else b}]]"


def expected_pairwise(texts: list[str]) -> list[float | None]:
    """Each completion's win rate over its comparisons with a verdict (both display orders), None without any."""
    wins, counted = [0.0] * len(texts), [0] * len(texts)
    for i, j in permutations(range(len(texts)), 2):
        if quality(texts[i]) != quality(texts[j]):
            wins[i] += float(quality(texts[i]) > quality(texts[j]))
            counted[i] += 1
    return [w / n if n else None for w, n in zip(wins, counted)]


def expected_ranking(texts: list[str]) -> list[float | None]:
    """(G-1-rank)/(G-1), ranks by quality, best first; None for a group of one."""
    if len(texts) < 2:
        return [None] * len(texts)
    order = sorted(range(len(texts)), key=lambda i: -quality(texts[i]))
    rank = {row: r for r, row in enumerate(order)}
    return [(len(texts) - 1 - rank[i]) / (len(texts) - 1) for i in range(len(texts))]


try:  # the processor itself, where vLLM is installed (the server's venv)
    import torch
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class SteeredVerdicts(AdapterLogitsProcessor):
        """Forces each request's output to be `verdict_for(its prompt)` then the end of sequence."""

        def __init__(self, vllm_config, device, is_pin_memory):
            super().__init__(vllm_config, device, is_pin_memory)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)

        def is_argmax_invariant(self) -> bool:
            return False  # it changes greedy decoding's choice

        def new_req_logits_processor(self, params):
            tokenizer, cache = self.tokenizer, {}

            def steer(prompt_ids, output_ids, logits):
                if "script" not in cache:
                    text = tokenizer.decode(list(prompt_ids), skip_special_tokens=False)
                    cache["script"] = tokenizer(verdict_for(text), add_special_tokens=False)["input_ids"] + [
                        tokenizer.eos_token_id
                    ]
                script = cache["script"]
                target = script[min(len(output_ids), len(script) - 1)]
                forced = torch.full_like(logits, float("-inf"))
                forced[target] = 0.0
                return forced

            return steer

except ImportError:  # the tests' own venv: the rule by hand only
    pass
