"""`expand`: short records into long prompts (LongRM section 4.2, appendix D.2).

A short record holds a question, the critical chunks that answer it (`chunks`, a list) or one source text
(`source`), the golden answer and optionally a perspective. For each target length, the chunks are placed among
distractor documents drawn from a corpus until the context is the target's number of tokens of the judge's tokenizer
(within `length_tolerance`). Each output record keeps:
- `long_context`: the distractors and the chunks, joined by `separator`; `context_tokens` its measured length;
- `short_context`: the chunks alone, what the judge sees (`judge` never shows it the distractors);
- `placements`: each chunk's `[start, end)` character span in `long_context` (the chunk verbatim, exactly once), and
  `insert_index`: the document index of the first chunk among the context's documents;
- `tag`: with `tag: true`, the chunks are wrapped in `<TAG>` ... `</TAG>` (a random tag, named in the judge's
  training prompt: LongRM's summarisation and safety data), else None.

A distractor never contains the golden answer (as a word, case-insensitive; answers shorter than
`min_answer_chars` are not checked and counted), a chunk or the tag; no document is used twice in one context; the
last one is cut at a token boundary to fill the target. Everything random follows `seed` and the record's id, so the
same seed gives the same output, and a resumed run the same records.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import string
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl_longrm.data.errors import DataFormatError, RunConfigError
from trl_longrm.datagen.records import Location, RecordSource, ResumableWriter, record_id
from trl_longrm.datagen.summary import StepStats


logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md")


@dataclass
class ExpandConfig:
    """Settings of `expand` (each field is a `--kebab-case` flag of `trl-longrm data expand`).

    Example:
    ```python
    >>> config = ExpandConfig(input="short.jsonl", corpus="wiki.jsonl", tokenizer="./judge", output="long.jsonl",
    ...                       target_lengths=[32768, 65536, 131072])
    >>> summary = expand(config)
    ```
    """

    input: str = field(
        metadata={
            "help": "Short records: `question`, `chunks` (list) or `source` (text), `answer`[, `perspective`, `id`]."
        }
    )
    corpus: str = field(
        metadata={
            "help": "Distractor documents: a JSON Lines / parquet file or `save_to_disk` dataset with a `text` column, "
            "or a folder of .txt / .md files."
        }
    )
    tokenizer: str = field(metadata={"help": "The judge's tokenizer (a checkpoint folder): lengths are its tokens."})
    output: str = field(metadata={"help": "Output JSON Lines file (resumable)."})
    target_lengths: list[int] = field(
        default_factory=lambda: [32768, 65536, 131072],
        metadata={
            "help": "Context lengths in tokens; one long record per short record and length. Default 32K 64K 128K."
        },
    )
    lengths_per_record: int | None = field(
        default=None,
        metadata={
            "help": "Expand each record at this many of `target_lengths`, drawn per record (seeded). Default None: at "
            "every one."
        },
    )
    length_tolerance: float = field(
        default=0.02,
        metadata={
            "help": "Largest relative difference of a context's tokens from its target (at least one token). Default "
            "0.02."
        },
    )
    seed: int = field(default=0, metadata={"help": "Seed of the draws (with each record's id). Default 0."})
    tag: bool = field(
        default=False,
        metadata={
            "help": "Wrap the chunks in a random `<TAG>` ... `</TAG>` named in the training prompt. Default False."
        },
    )
    placement: str = field(
        default="scattered",
        metadata={
            "help": "'scattered': each chunk at its own place among the distractors (in order; multi-hop); "
            "'together': the chunks as one block (always so with `tag`). Default scattered.",
            "choices": ["scattered", "together"],
        },
    )
    separator: str = field(default="\n\n", metadata={"help": "Text between documents. Default a blank line."})
    perspective: str = field(
        default="faithfulness",
        metadata={"help": "Perspective of records without one (a rubric of the prompts file). Default faithfulness."},
    )
    min_answer_chars: int = field(
        default=3,
        metadata={"help": "Distractors are checked for golden answers of at least this many characters. Default 3."},
    )
    text_key: str = field(default="text", metadata={"help": "The corpus's text column. Default `text`."})
    split: str | None = field(default=None, metadata={"help": "Split of a `save_to_disk` input with several."})

    def __post_init__(self):
        self.target_lengths = [int(length) for length in self.target_lengths]
        if not self.target_lengths or min(self.target_lengths) < 16:
            raise ValueError(f"`target_lengths` must be lengths of at least 16 tokens, got {self.target_lengths}.")
        if self.lengths_per_record is not None and not 1 <= self.lengths_per_record <= len(self.target_lengths):
            raise ValueError(
                f"`lengths_per_record` must be between 1 and {len(self.target_lengths)} (the target lengths), got "
                f"{self.lengths_per_record}."
            )
        if not 0 < self.length_tolerance < 0.5:
            raise ValueError(f"`length_tolerance` must be in (0, 0.5), got {self.length_tolerance}.")
        if self.placement not in ("scattered", "together"):
            raise ValueError(f"`placement` must be 'scattered' or 'together', got {self.placement!r}.")


def _normalised(text: str) -> str:
    return " ".join(text.casefold().split())


def _seeded(*parts) -> random.Random:
    """A generator of its own for each record (and length): draws that do not depend on the order of records."""
    digest = hashlib.sha256("\x00".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


class Corpus:
    """The distractor documents, their token counts measured once each as they are drawn."""

    def __init__(self, path: str, tokenizer, text_key: str = "text"):
        self.path = path
        self.tokenizer = tokenizer
        self.texts = self._read(Path(path), text_key)
        if not self.texts:
            raise DataFormatError("the corpus holds no documents", source=path)
        self._tokens: dict[int, int] = {}
        self._normal: dict[int, str] = {}

    def _read(self, path: Path, text_key: str) -> list[str]:
        is_dataset = path.is_dir() and any(
            (path / name).exists() for name in ("dataset_info.json", "dataset_dict.json", "state.json")
        )
        if path.is_dir() and not is_dataset:
            files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
            if not files:
                raise DataFormatError(
                    f"a folder of documents needs {' or '.join(TEXT_SUFFIXES)} files; none found", source=str(path)
                )
            return [text for text in (f.read_text(encoding="utf-8", errors="replace").strip() for f in files) if text]
        texts = []
        for where, record in RecordSource(str(path)):
            text = record.get(text_key)
            if not isinstance(text, str):
                raise where.error(f"a corpus document needs a text, got {type(text).__name__}", key=text_key)
            if text.strip():
                texts.append(text.strip())
        return texts

    def __len__(self) -> int:
        return len(self.texts)

    def tokens(self, index: int) -> int:
        if index not in self._tokens:
            self._tokens[index] = len(self.tokenizer(self.texts[index], add_special_tokens=False)["input_ids"])
        return self._tokens[index]

    def normalised(self, index: int) -> str:
        if index not in self._normal:
            self._normal[index] = _normalised(self.texts[index])
        return self._normal[index]

    def draw(self, rng: random.Random):
        """The documents' indices in a random order, each once (random probes first: a large corpus is never
        shuffled whole for one record)."""
        seen = set()
        for _ in range(min(4 * len(self), 1 << 20)):
            index = rng.randrange(len(self))
            if index not in seen:
                seen.add(index)
                yield index
            if len(seen) == len(self):
                return
        rest = [index for index in range(len(self)) if index not in seen]
        rng.shuffle(rest)
        yield from rest


def head_tokens(tokenizer, text: str, count: int) -> str:
    """The beginning of `text` that holds its first `count` tokens (cut at a token boundary)."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    if count >= len(offsets):
        return text
    return text[: offsets[count][0]].rstrip()


def random_tag(rng: random.Random) -> str:
    """A tag name like LongRM's (`YJ6`): two capital letters and a digit."""
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(2)) + rng.choice(string.digits)


class Expander:
    """Builds the long contexts of one configuration (see the module's docstring)."""

    def __init__(self, config: ExpandConfig, tokenizer, corpus: Corpus):
        self.config = config
        self.tokenizer = tokenizer
        self.corpus = corpus
        self.separator_tokens = len(tokenizer(config.separator, add_special_tokens=False)["input_ids"])
        self.unchecked_answers = 0
        self.excluded = 0  # distractors passed over: they held the answer, a chunk or the tag

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def expand(self, where: Location, rid: str, record: dict, target: int) -> dict:
        config = self.config
        chunks = self.chunks(where, record)
        answer = record["answer"]
        rng = _seeded(config.seed, rid, target)
        tag = None
        if config.tag:
            tag = random_tag(rng)
            while any(tag in chunk for chunk in chunks):
                tag = random_tag(rng)
        # The pieces placed among the distractors: one block (tagged or together) or each chunk.
        if tag is not None or config.placement == "together":
            joined = config.separator.join(chunks)
            blocks = [f"<{tag}>\n{joined}\n</{tag}>" if tag else joined]
        else:
            blocks = list(chunks)
        banned = [_normalised(chunk) for chunk in chunks] + ([tag.casefold()] if tag else [])
        answer_pattern = None
        if len(answer.strip()) >= config.min_answer_chars:
            answer_pattern = re.compile(r"(?<!\w)" + re.escape(_normalised(answer)) + r"(?!\w)")
        else:
            self.unchecked_answers += 1
        budget = target - sum(self.count(block) for block in blocks) - self.separator_tokens * len(blocks)
        documents, ids = self.distractors(where, rng, budget, banned, answer_pattern, target)
        # Where the blocks go among the documents: in order, each at its own slot.
        slots = sorted(rng.sample(range(len(documents) + len(blocks)), len(blocks)))
        for _ in range(6):
            parts, kinds = [], []
            remaining = iter(documents)
            for slot in range(len(documents) + len(blocks)):
                if slot in slots:
                    parts.append(blocks[slots.index(slot)])
                    kinds.append("block")
                else:
                    parts.append(next(remaining))
                    kinds.append("document")
            text = config.separator.join(parts)
            length = self.count(text)
            # The tolerance, and at least one token either way (a short target cannot always be hit exactly).
            slack = max(target * config.length_tolerance, 1)
            low, high = target - slack, target + slack
            if low <= length <= high or (length > high and not documents):
                break
            # Token merges at the joins move the length a little from the sum of the parts': cut or fill the last
            # distractor by the difference, and measure again.
            if length > high:
                last = documents[-1]
                documents[-1] = head_tokens(self.tokenizer, last, max(self.count(last) - (length - target), 1))
            else:
                extra = self.more(where, rng, target - length, banned, answer_pattern, ids, target)
                if documents:
                    documents[-1] = documents[-1] + config.separator + extra
                else:  # the chunks nearly fill the target: a scrap of one distractor, at a place of its own
                    documents.append(extra)
                    slots = sorted(rng.sample(range(len(documents) + len(blocks)), len(blocks)))
        if not low <= length <= high:
            raise where.error(
                f"could not fit a context of {target} tokens within {config.length_tolerance:.0%} (got {length}): its "
                "chunks take most of it; raise the target"
            )
        placements, offset, first_block = [], 0, None
        block_starts = []
        for index, (part, kind) in enumerate(zip(parts, kinds, strict=True)):
            if kind == "block":
                block_starts.append((offset, part))
                if first_block is None:
                    first_block = index
            offset += len(part) + len(config.separator)
        for start, block in block_starts:
            for chunk in chunks:
                position = block.find(chunk)
                if position >= 0 and (tag is not None or config.placement == "together" or block == chunk):
                    placements.append([start + position, start + position + len(chunk)])
        placements.sort()
        return {
            "id": f"{rid}@{target}",
            "source_id": rid,
            "question": record["question"],
            "answer": answer,
            "perspective": record.get("perspective") or config.perspective,
            "short_context": config.separator.join(chunks),
            "long_context": text,
            "target_tokens": target,
            "context_tokens": length,
            "insert_index": first_block,
            "placements": placements,
            "tag": tag,
            "num_documents": len(parts),
            "distractor_ids": ids,
        }

    def chunks(self, where: Location, record: dict) -> list[str]:
        if record.get("chunks") is not None:
            chunks = record["chunks"]
            if not isinstance(chunks, list) or not chunks or not all(isinstance(c, str) and c.strip() for c in chunks):
                raise where.error("must be a non-empty list of non-empty texts", key="chunks")
            return [chunk.strip() for chunk in chunks]
        source = record.get("source")
        if not isinstance(source, str) or not source.strip():
            raise where.error("a record needs `chunks` (a list of texts) or `source` (a text)", key="source")
        return [source.strip()]

    def _usable(self, index: int, banned: list[str], answer_pattern) -> bool:
        text = self.corpus.normalised(index)
        if any(b in text for b in banned):
            return False
        return answer_pattern is None or answer_pattern.search(text) is None

    def distractors(self, where, rng, budget, banned, answer_pattern, target) -> tuple[list[str], list[int]]:
        """Distractor texts filling `budget` tokens (the last cut to fit), and their corpus indices."""
        documents, ids, used = [], [], 0
        for index in self.corpus.draw(rng):
            if used >= budget:
                break
            if not self._usable(index, banned, answer_pattern):
                self.excluded += 1
                continue
            cost = self.corpus.tokens(index) + self.separator_tokens
            if used + cost <= budget:
                documents.append(self.corpus.texts[index])
                used += cost
            else:
                keep = budget - used - self.separator_tokens
                if keep < 1:
                    break
                documents.append(head_tokens(self.tokenizer, self.corpus.texts[index], keep))
                used = budget
            ids.append(index)
        if used < budget - self.config.length_tolerance * target:
            raise where.error(
                f"the corpus {self.corpus.path} is too short for a context of {target} tokens: its documents that "
                f"contain neither the answer nor a chunk fill {used:,} of the {budget:,} tokens left beside the "
                "chunks; add documents or lower `target_lengths`"
            )
        return documents, ids

    def more(self, where, rng, tokens, banned, answer_pattern, ids, target) -> str:
        """Another `tokens` tokens of an unused distractor, to fill a context a join made short."""
        for index in self.corpus.draw(rng):
            if index in ids or not self._usable(index, banned, answer_pattern):
                continue
            ids.append(index)
            return head_tokens(self.tokenizer, self.corpus.texts[index], max(tokens - self.separator_tokens, 1))
        raise where.error(f"the corpus {self.corpus.path} is too short for a context of {target} tokens")


def targets_of(config: ExpandConfig, rid: str) -> list[int]:
    """The target lengths of record `rid`: all of them, or `lengths_per_record` drawn for it (seeded by its id)."""
    if config.lengths_per_record is None:
        return list(config.target_lengths)
    drawn = _seeded(config.seed, rid, "lengths").sample(config.target_lengths, config.lengths_per_record)
    return sorted(drawn)


def expand(config: ExpandConfig) -> dict:
    """Run `expand`: every record of `config.input` at every target length not in `config.output` yet. Returns the
    summary (also printed and written beside the output)."""
    from transformers import AutoTokenizer

    source = RecordSource(config.input, required=("question", "answer"), split=config.split)
    total = source.check() * (config.lengths_per_record or len(config.target_lengths))
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    except (OSError, ValueError) as error:
        from trl_longrm.evaluation.runner import model_error

        raise model_error(config.tokenizer, error) from None
    if not Path(config.corpus).exists():
        from trl_longrm.data.sources import missing_path_message

        raise RunConfigError(f"corpus {config.corpus}: {missing_path_message(config.corpus)}")
    corpus = Corpus(config.corpus, tokenizer, config.text_key)
    identity = {key: value for key, value in asdict(config).items() if key not in ("output",)}
    identity["tokenizer"] = (
        str(Path(config.tokenizer).resolve()) if Path(config.tokenizer).exists() else config.tokenizer
    )
    expander = Expander(config, tokenizer, corpus)
    for where, record in source:  # every record's chunks and texts, before anything is written
        expander.chunks(where, record)
        for key in ("question", "answer"):
            if not isinstance(record[key], str) or not record[key].strip():
                raise where.error("must be a non-empty text", key=key)
    with (
        ResumableWriter(config.output, identity) as writer,
        StepStats("expand", config.output, total, resumed=len(writer.done)) as stats,
    ):
        for where, record in source:
            rid = record_id(where, record)
            for target in targets_of(config, rid):
                if f"{rid}@{target}" in writer.done:
                    continue
                out = expander.expand(where, rid, record, target)
                extra = {
                    key: value for key, value in record.items() if key not in out and key not in ("chunks", "source")
                }
                writer.write({**out, **extra})
                stats.written += 1
                stats.advance()
        stats.extra["answers_too_short_to_check"] = expander.unchecked_answers
        stats.extra["distractors_excluded"] = expander.excluded
        stats.extra["corpus_documents"] = len(corpus)
        return stats.finish()
