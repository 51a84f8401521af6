"""`--protocol longrm` at its two seams, on a byte-level tokenizer where a CJK character takes three tokens:

- the cut: LongRM's evaluator renders the prompt's ids, keeps the first `max_length // 2` and last `max_length //2 - 5`,
  decodes them to text and its vLLM engine tokenizes that text again; a cut inside a character so becomes U+FFFD and
  other ids at the seam. The reference is those steps written out here (from LongRM's `get_prompt`);
- the end: LongRM stores vLLM's text of a judgment, which vLLM's detokenizer builds with tokenizers' `DecodeStream`
  (emitting nothing for bytes that do not yet make a character): the reference is that `DecodeStream`, run here."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from trl_longrm.evaluation.judges import GenerativeJudge, _chat_ids
from trl_longrm.testing_utils import build_chat_tokenizer, build_tiny_model


def judge(tokenizer, protocol, max_length=96):
    model = build_tiny_model("llama", "causal-lm", tokenizer, seed=0)
    return GenerativeJudge(model, tokenizer, max_length=max_length, max_new_tokens=8, verdict_probs=False,
                           evaluation_protocol=protocol)  # fmt: skip


def longrm_reference(tokenizer, messages, max_length):
    """LongRM's steps: chat-template ids, the head/tail cut at >= max_length, decode, tokenize the text again."""
    ids = _chat_ids(tokenizer, messages, add_generation_prompt=True)
    if len(ids) >= max_length:
        ids = ids[: max_length // 2] + ids[len(ids) - (max_length - max_length // 2 - 5) :]
    return tokenizer(tokenizer.decode(ids), add_special_tokens=False)["input_ids"], ids


def test_a_cut_inside_a_character_is_longrm_s_seam():
    tokenizer = build_chat_tokenizer()
    messages = [{"role": "user", "content": "漢字" * 60 + " the end"}]
    seams = 0
    for max_length in range(90, 110):
        expected, plain_cut = longrm_reference(tokenizer, messages, max_length)
        ids, cut = judge(tokenizer, "longrm", max_length)._prompt_ids(messages)
        assert cut and ids == expected, max_length
        seams += ids != plain_cut
        assert "\ufffd" in tokenizer.decode(ids) or ids == plain_cut
    assert seams >= 5  # most of these cuts fall inside a character: the seam is really exercised


def test_a_judgment_ending_inside_a_character_ends_as_vllm_s_text():
    tokenizer = build_chat_tokenizer()
    whole = tokenizer("[[A]] 漢字", add_special_tokens=False)["input_ids"]
    for end in range(1, len(whole) + 1):
        ids = whole[:end]
        stream = DecodeStream(skip_special_tokens=True)
        engine_text = "".join(piece for i in ids if (piece := stream.step(tokenizer.backend_tokenizer, i)) is not None)
        assert judge(tokenizer, "longrm")._decode(ids) == engine_text, end
    partial = whole[:-1]  # the last character's last byte missing
    assert judge(tokenizer, "default")._decode(partial).endswith("\ufffd")  # the default protocol keeps the mark
    assert not judge(tokenizer, "longrm")._decode(partial).endswith("\ufffd")
