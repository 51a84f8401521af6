"""trl_longrm: long-context reward models (LongRM) on top of TRL and PEFT."""

__version__ = "0.1.0"
