"""`accelerate launch recipe.yaml`: the source encoding that makes a recipe a Python program that trains it.

`accelerate launch recipe.yaml` runs `python recipe.yaml` on every process (as `torchrun recipe.yaml` does). A recipe's
first line, `# -*- coding: trl_longrm -*-`, is a comment to YAML and, to Python, the file's source encoding (PEP 263):
Python reads the file through this codec, which turns every line of the recipe into a comment and ends it with one
line that runs the recipe, with the arguments after it, as `python -m trl_longrm recipe.yaml ARGS` does. So any YAML
works, whatever its values look like as Python.

Python finds the codec through a search function that `trl_longrm.pth` registers at interpreter start (pip installs
it beside the package, see setup.py); the search imports this module only when a file names the encoding.
"""

from __future__ import annotations

import codecs

from trl_longrm.launch import RECIPE_CODEC


# What Python runs after the recipe's lines: the recipe's path is `__file__` of the `__main__` module.
PROGRAM = "import sys; from trl_longrm.recipe_codec import run; sys.exit(run(__file__, sys.argv[1:]))\n"


class IncrementalDecoder(codecs.IncrementalDecoder):
    """UTF-8 text with every line commented out, then `PROGRAM` once the input ends.

    Python's tokenizer may hand the decoder the file from the middle of its first line on (it has read the coding
    line itself), so each line is commented wherever it starts; `\\r` ends a line too, as in Python source."""

    def __init__(self, errors: str = "strict"):
        super().__init__(errors)
        self.reset()

    def decode(self, input: bytes, final: bool = False) -> str:
        text = self.utf8.decode(input, final)
        out = []
        for char in text:
            if self.line_start and char not in "\r\n":
                out.append("# ")
                self.line_start = False
            out.append(char)
            if char in "\r\n":
                self.line_start = True
        if final and not self.ended:
            # Once: a reader at the end of the file asks again, and must then get nothing (end of file).
            out.append(("" if self.line_start else "\n") + PROGRAM)
            self.line_start, self.ended = True, True
        return "".join(out)

    def reset(self) -> None:
        self.utf8 = codecs.getincrementaldecoder("utf-8")(self.errors)
        self.line_start = True
        self.ended = False

    def getstate(self):
        buffered, flag = self.utf8.getstate()
        return buffered, 4 * flag + 2 * int(self.ended) + int(self.line_start)

    def setstate(self, state) -> None:
        buffered, flag = state
        self.utf8.setstate((buffered, flag // 4))
        self.ended, self.line_start = bool(flag & 2), bool(flag & 1)


def decode(input: bytes, errors: str = "strict") -> tuple[str, int]:
    return IncrementalDecoder(errors).decode(bytes(input), final=True), len(input)


def codec_info() -> codecs.CodecInfo:
    return codecs.CodecInfo(
        name=RECIPE_CODEC,
        encode=codecs.utf_8_encode,  # the recipe's own text, as UTF-8
        decode=decode,
        incrementalencoder=codecs.getincrementalencoder("utf-8"),
        incrementaldecoder=IncrementalDecoder,
    )


def search(name: str) -> codecs.CodecInfo | None:
    """The codec search function (`codecs.register`) that `trl_longrm.pth` registers."""
    return codec_info() if name == RECIPE_CODEC else None


def run(recipe: str, argv: list[str]) -> int:
    """What `accelerate launch recipe.yaml ARGS` runs on every process: the recipe's stage with ARGS overriding its
    values, as `python -m trl_longrm recipe.yaml ARGS`; a note (rank 0) where the processes started are not the ones
    the recipe's `accelerate_config` / `num_processes` ask for."""
    from trl_longrm.launch import launch_mismatch
    from trl_longrm.train import main

    try:
        mismatch = launch_mismatch(recipe, argv)
    except (OSError, ValueError):  # an unreadable recipe or a bad number: `main` reports it
        mismatch = None
    return main([recipe, *argv], notes=[mismatch] if mismatch else [])
