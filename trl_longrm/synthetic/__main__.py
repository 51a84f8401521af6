"""`python -m trl_longrm.synthetic --output-dir DIR [options]`: write a synthetic judging suite (see `SyntheticConfig`).

Example:
```bash
python -m trl_longrm.synthetic --output-dir /tmp/synthetic --seed 0 --num-train 400 --lengths 4k=300 8k=700 16k=1500
```
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from trl_longrm.dataclass_flags import flag_type
from trl_longrm.synthetic.suite import SyntheticConfig, generate_synthetic_suite


def _bucket(text: str) -> tuple[str, int]:
    name, sep, tokens = text.partition("=")
    if not sep or not name or not tokens.isdigit():
        raise argparse.ArgumentTypeError(f"expected BUCKET=TOKENS such as 4k=300, got {text!r}")
    return name, int(tokens)


def build_parser() -> argparse.ArgumentParser:
    """An argument parser with one `--kebab-case` flag per `SyntheticConfig` field, plus `--output-dir`."""
    parser = argparse.ArgumentParser(prog="python -m trl_longrm.synthetic", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True, help="Directory to write the suite into. Required.")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Overwrite suite files found in --output-dir without a manifest.json (an interrupted run). Default: "
        "refuse; a suite with a manifest is always replaced.",
    )
    defaults = SyntheticConfig()
    for f in dataclasses.fields(SyntheticConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kwargs = {"dest": f.name, "help": f.metadata["help"], "default": None}
        if isinstance(default, bool):  # `type=bool` would read "False" as True
            kwargs["action"] = argparse.BooleanOptionalAction
        elif isinstance(default, dict):
            kwargs.update(nargs="+", type=_bucket, metavar="BUCKET=TOKENS")
        elif isinstance(default, (list, tuple)):
            item = type(default[0])
            kwargs.update(nargs=len(default) if isinstance(default, tuple) else "+", type=item)
        else:  # a scalar, or None for an optional one (`int | None`: int)
            kwargs["type"] = flag_type(SyntheticConfig, f, default)
        parser.add_argument(flag, **kwargs)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(sys.argv[1:] if argv is None else argv))
    output_dir = args.pop("output_dir")
    overwrite = args.pop("overwrite")
    overrides = {k: v for k, v in args.items() if v is not None}
    if "lengths" in overrides:
        overrides["lengths"] = dict(overrides["lengths"])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        suite = generate_synthetic_suite(output_dir, overwrite=overwrite, **overrides)
    except (FileExistsError, ValueError) as error:  # a folder it will not write into, or bad settings
        print(f"python -m trl_longrm.synthetic: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(json.loads(suite.manifest.read_text(encoding="utf-8"))["counts"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
