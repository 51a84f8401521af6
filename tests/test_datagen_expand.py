"""`trl-longrm data expand`: short records into long prompts at target lengths of a real (byte-level BPE) tokenizer."""

import pytest
from datagen_helpers import read_jsonl, short_records, write_corpus, write_jsonl

from trl_longrm.data.errors import DataFormatError
from trl_longrm.datagen.expand import ExpandConfig, expand
from trl_longrm.datagen.prompts import DataPrompts
from trl_longrm.testing_utils import build_chat_tokenizer


TARGETS = [300, 1200, 3000]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("expand")
    tokenizer = build_chat_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    # Planted: a document stating an answer, and one holding a chunk: neither may be drawn as a distractor.
    planted = ["In the archive zebra1 was the word of the day.", "Notes. The secret code 2 is zebra2. End of notes."]
    return {
        "root": root,
        "tokenizer": tokenizer,
        "tokenizer_path": str(root / "tokenizer"),
        "corpus": write_corpus(root / "corpus.jsonl", planted=planted),
        "input": write_jsonl(root / "short.jsonl", short_records()),
        "planted": planted,
    }


def _expand(assets, name, **overrides):
    settings = dict(input=assets["input"], corpus=assets["corpus"], tokenizer=assets["tokenizer_path"],
                    output=str(assets["root"] / name), target_lengths=TARGETS)  # fmt: skip
    summary = expand(ExpandConfig(**{**settings, **overrides}))
    return read_jsonl(settings["output"] if "output" not in overrides else overrides["output"]), summary


@pytest.mark.parametrize("placement", ["scattered", "together"])
def test_contexts_hold_the_chunks_once_within_the_target(assets, placement):
    rows, summary = _expand(assets, f"{placement}.jsonl", placement=placement)
    tokenizer, records = assets["tokenizer"], {r["id"]: r for r in short_records()}
    corpus = [line["text"] for line in read_jsonl(assets["corpus"])]
    assert len(rows) == 9 and summary["written"] == 9
    for row in rows:
        record = records[row["source_id"]]
        context = row["long_context"]
        measured = len(tokenizer(context, add_special_tokens=False)["input_ids"])
        assert measured == row["context_tokens"]
        assert abs(measured - row["target_tokens"]) <= max(0.02 * row["target_tokens"], 1), row["id"]
        # Each chunk verbatim, exactly once, where the record says.
        assert len(row["placements"]) == 2
        for (start, end), chunk in zip(row["placements"], record["chunks"], strict=True):
            assert context[start:end] == chunk and context.count(chunk) == 1
        # No distractor holds the answer (or a chunk): the answer appears only inside the chunks.
        outside = context
        for start, end in sorted(row["placements"], reverse=True):
            outside = outside[:start] + outside[end:]
        assert record["answer"] not in outside
        for index in row["distractor_ids"]:
            assert record["answer"] not in corpus[index]
            assert not any(chunk in corpus[index] for chunk in record["chunks"])
        assert row["short_context"] == "\n\n".join(record["chunks"])
        if placement == "together":
            assert row["placements"][1][0] == row["placements"][0][1] + 2
        # The judge's request holds the short context and none of the distractors.
        judged = DataPrompts.default().judge_messages("faithfulness", row["short_context"], row["question"],
                                                      row["answer"], "some response")  # fmt: skip
        text = "\n".join(message["content"] for message in judged)
        assert row["short_context"] in text
        assert not any(corpus[index][:80] in text for index in row["distractor_ids"])


def test_documents_holding_an_answer_or_a_chunk_are_never_drawn(assets, tmp_path):
    """A corpus just long enough that every filler document is needed: the planted ones are passed over for the
    records whose answer or chunk they hold (and drawn for the others)."""
    corpus = write_corpus(tmp_path / "tight.jsonl", num_documents=12, seed=1, planted=assets["planted"])
    texts = [line["text"] for line in read_jsonl(corpus)]
    filler = sum(len(assets["tokenizer"](text)["input_ids"]) + 1 for text in texts[:12])
    rows, summary = _expand(assets, "tight_out.jsonl", corpus=corpus, target_lengths=[int(filler * 0.95)])
    used = {row["source_id"]: set(row["distractor_ids"]) for row in rows}
    assert 12 not in used["q1"] and 13 not in used["q2"]  # zebra1's document, the document with q2's chunk
    assert 12 in used["q0"] and 13 in used["q0"]
    assert summary["distractors_excluded"] >= 1  # counted (how many depends on when each context was full)


def test_same_seed_same_output_and_resume(assets):
    first, _ = _expand(assets, "a.jsonl", seed=3)
    again, _ = _expand(assets, "b.jsonl", seed=3)
    other, _ = _expand(assets, "c.jsonl", seed=4)
    assert first == again
    assert [r["long_context"] for r in first] != [r["long_context"] for r in other]
    # A run killed while writing its fifth record: the same command finishes with the same records, the first four
    # kept (not redone).
    path = assets["root"] / "killed.jsonl"
    lines = (assets["root"] / "a.jsonl").read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:4]) + lines[4][:50])
    (assets["root"] / "killed.jsonl.run.json").write_text((assets["root"] / "a.jsonl.run.json").read_text())
    resumed, summary = _expand(assets, "killed.jsonl", seed=3)
    assert resumed == first and summary["resumed"] == 4 and summary["written"] == 5
    # Other settings on the same output are refused, naming them.
    with pytest.raises(Exception, match="seed: 3 -> 5"):
        _expand(assets, "killed.jsonl", seed=5)


def test_tags_wrap_the_source_and_name_it_in_the_training_prompt(assets):
    rows, _ = _expand(assets, "tagged.jsonl", tag=True, target_lengths=[1200])
    for row in rows:
        tag = row["tag"]
        assert len(tag) == 3 and row["long_context"].count(f"<{tag}>") == 1
        start = row["long_context"].index(f"<{tag}>")
        assert start < row["placements"][0][0] < row["placements"][1][1] < row["long_context"].index(f"</{tag}>")
        system = DataPrompts.default().train_messages("faithfulness", row["long_context"], row["question"], "r", tag)
        assert f"<{tag}> and </{tag}>" in system[0]["content"]


def test_user_mistakes_name_the_file_and_record(assets, tmp_path):
    short = write_jsonl(tmp_path / "bad.jsonl", [short_records()[0], {"id": "x", "question": "Q?", "answer": "A"}])
    with pytest.raises(DataFormatError, match=r"bad.jsonl, line 2, key 'source'"):
        _expand(assets, "bad_out.jsonl", input=short)
    assert not (assets["root"] / "bad_out.jsonl").exists()  # checked before anything is written
    missing = write_jsonl(tmp_path / "missing.jsonl", [{"question": "Q?", "chunks": ["c"]}])
    with pytest.raises(DataFormatError, match=r"missing.jsonl, line 1, key 'answer'"):
        _expand(assets, "missing_out.jsonl", input=missing)
    small = write_corpus(tmp_path / "small.jsonl", num_documents=3)
    with pytest.raises(
        DataFormatError,
        match=r"short.jsonl, line 1: the corpus .*small.jsonl is too short for a context of 1200 tokens",
    ):
        _expand(assets, "small_out.jsonl", corpus=small)


def test_lengths_per_record_draws_its_targets(assets):
    rows, summary = _expand(assets, "drawn.jsonl", lengths_per_record=2)
    targets = {}
    for row in rows:
        targets.setdefault(row["source_id"], []).append(row["target_tokens"])
    assert summary["records"] == 6 and all(len(t) == 2 and set(t) <= set(TARGETS) for t in targets.values())
    again, _ = _expand(assets, "drawn_again.jsonl", lengths_per_record=2)
    assert again == rows
