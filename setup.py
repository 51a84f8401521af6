"""Package metadata lives in pyproject.toml; this file only adds `trl_longrm.pth` to the installed files.

`accelerate launch recipe.yaml` runs `python recipe.yaml`, and a recipe's first line `# coding: trl_longrm` makes
Python read it through `trl_longrm.recipe_codec`. Python finds that codec through the search function this one-line
`.pth` registers at interpreter start (site-packages runs a `.pth` line that starts with `import`); the search imports
the package only when a file names the encoding, so other programs pay nothing but the registration.
"""

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel


PTH_NAME = "trl_longrm.pth"
PTH_LINE = (
    "import codecs; codecs.register(lambda name: name == 'trl_longrm' "
    "and __import__('trl_longrm.recipe_codec').recipe_codec.search(name) or None)\n"
)


class build_py_with_pth(build_py):
    """A wheel holds the `.pth` at its root, beside the package: pip installs it into site-packages."""

    def run(self):
        super().run()
        if not self.editable_mode:
            with open(f"{self.build_lib}/{PTH_NAME}", "w", encoding="utf-8") as f:
                f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, f"{self.build_lib}/{PTH_NAME}"]


class editable_wheel_with_pth(editable_wheel):
    """`pip install -e .`: the editable wheel holds the `.pth` too (it imports the package from the checkout)."""

    def _select_strategy(self, name, tag, build_lib):
        return _WithPth(super()._select_strategy(name, tag, build_lib))


class _WithPth:
    """An editable-install strategy that also writes `trl_longrm.pth` into the wheel."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH_NAME, PTH_LINE.encode("utf-8"))

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self.strategy.__exit__(*exc)


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
